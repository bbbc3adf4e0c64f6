#!/bin/bash
S='speedup \(ratio|TPOT ms|error'
run() { local dir=$1 label=$2; shift 2
  echo "== $label"; (cd $dir && python -m harness "$@" wandb.mode=disabled force=true out_dir=/tmp/timing/$label 2>&1 | grep -E "$S"); }
run /work/main after-default-2
run /tmp/before before-default-2
echo DONE
