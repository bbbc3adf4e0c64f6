#!/bin/bash
# back to back on one machine: eager before (5d4a58c) / after, then compile=false / true per pair and batch size
S='speedup \(ratio|TPOT ms|efficiency|recompiles|target step ms|error'
run() { # dir label args...
  local dir=$1 label=$2; shift 2
  echo "== $label"; (cd $dir && python -m harness "$@" wandb.mode=disabled force=true out_dir=/tmp/timing/$label 2>&1 | grep -E "$S")
}
run /tmp/before before-default
run /work/main after-default
run /tmp/before before-smollm2 +pair=smollm2 k=1
run /work/main after-smollm2 +pair=smollm2 k=1
for p in smollm2_eagle smollm2 smollm2_ngram; do
 for b in 1 4; do
  for c in false true; do
   run /work/main $p-b$b-compile-$c +pair=$p batch_size=$b compile=$c dataset.num_prompts=12 max_new_tokens=48
  done
 done
done
echo DONE
