#!/usr/bin/env bash
# The performance check on a machine with a GPU, in one command (under 10 minutes on one H200):
#   bash scripts/gpu_check.sh            # writes results/bench/gpu_* ($OUT/ when set) and prints the figures
# Runs on the embedded pairs (offline: no hub access needed), eager (HF's forward), dynamic cache unless said:
#   1. harness.bench with the EAGLE-3 head (smollm2_eagle), compiled: our loop against the target alone
#      (HF has no feature-head path), limit (the head's proposal cost in the loop against its cost
#      timed apart, on one clock), efficiency, overhead, host syncs;
#   2. python -m harness over batch_size 1 and 8 for the head, the 4-layer draft and prompt lookup, compiled
#      (compile=true: the lean forward's and the head's steps captured, CUDA graphs; recompiles after warm-up counted)
#      (16 builtin prompts x 32 tokens, k=2): speedup against batch size, packed as gpu_batch_sweep.tar.gz;
#   3. harness.bench with the model draft (smollm2): ours vs HF generate / assisted / prompt lookup,
#      efficiency, memory over 100 prompts, and our batched baseline against generate() on
#      a left-padded batch of 4;
#   4. static cache + torch.compile of both models, against HF generate's own compiled
#      path (static cache + compile_config): throughput, efficiency and overhead, in the time that is left.
# With --distill it runs one other part instead: the embedded EAGLE-3 head distilled on the GPU
# (python -m harness.distill --kind eagle3 --one-pass --device cuda, several prompt seeds and
# temperatures: more of the target's text than 2 CPU cores sample in an hour), the head written to
# $OUT/smollm2_eagle (config.json, model.safetensors, harness_head.json) with its log.
#
# On a GPU machine without network access that receives at most 64 MiB of files per command
# (scripts/gpu_payload.sh packs what it lacks into parts of that size):
#   bash scripts/gpu_check.sh --stash .gpu/1          # keep a payload part on the machine
#   bash scripts/gpu_check.sh --stash .gpu/N --run    # the last part: install, assemble, run
# --rehearse runs the same steps on the CPU with tiny sizes, to test this script without a GPU.
# PYTHON names the interpreter (default python3); every bench part runs as $PYTHON -m harness.bench.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STASH=${SPECBENCH_PAYLOAD:-/tmp/specbench-payload}
stash="" run=1 rehearse=0 seconds=570 distill=0
while [ $# -gt 0 ]; do
    case "$1" in
        --stash) stash=$2; run=0; shift 2 ;;
        --run) run=1; shift ;;
        --rehearse) rehearse=1; shift ;;
        --distill) distill=1; shift ;;
        --seconds) seconds=$2; shift 2 ;;
        *) echo "usage: bash scripts/gpu_check.sh [--stash DIR [--run]] [--seconds S] [--rehearse] [--distill]" >&2; exit 2 ;;
    esac
done
case "$seconds" in
    ''|*[!0-9]*) echo "error: --seconds $seconds: give a whole number of seconds (570 fits a 10-minute limit per command)" >&2; exit 2 ;;
esac
seconds=$((10#$seconds))  # decimal, also with a leading zero (bash reads 0300 as octal)
if [ "$seconds" -lt 180 ]; then
    echo "error: --seconds $seconds: the check needs at least 180 s (eager part, then the compiled and lean parts)" >&2; exit 2
fi

if [ -n "$stash" ]; then
    mkdir -p "$STASH" && cp -r "$stash"/. "$STASH"/
    echo "stashed $(du -sb "$stash" | cut -f1) bytes from $stash; $STASH now holds:"; ls -R "$STASH" | sed 's/^/  /'
    $PY - <<'EOF'
import importlib.metadata as md, platform
names = "torch transformers tokenizers huggingface-hub accelerate safetensors numpy scipy pandas pyarrow fsspec xxhash tqdm pyyaml seaborn hydra-core omegaconf gguf datasets dill multiprocess wandb".split()
def version(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print("python", platform.python_version(), "|", ", ".join(f"{n} {version(n)}" for n in names))
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi -L || true
fi
[ "$run" = 1 ] || exit 0

if [ -f "$STASH/COMMIT" ]; then  # the commit the payload was packed at (harness.runner.cell.harness_commit), also where a stale .git came along
    export SPECBENCH_COMMIT=$(cat "$STASH/COMMIT")
fi
if [ -d "$STASH" ]; then  # a payload was stashed: install its wheels, assemble the GGUF file
    if compgen -G "$STASH/wheels/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/specbench-site "$STASH"/wheels/*.whl
        export PYTHONPATH=/tmp/specbench-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    if compgen -G "$STASH/*.part-*" >/dev/null && [ ! -f "$STASH/SHA256SUMS" ]; then
        echo "error: $STASH holds GGUF parts but not SHA256SUMS (packed into .gpu/1): stash every .gpu/N part first" >&2; exit 1
    fi
    if [ -f "$STASH/SHA256SUMS" ]; then
        export SPECBENCH_CACHE=${SPECBENCH_CACHE:-/tmp/specbench-cache}
        mkdir -p "$SPECBENCH_CACHE/gguf"
        name=$(awk '{print $2}' "$STASH/SHA256SUMS")
        cat "$STASH/$name".part-* > "$SPECBENCH_CACHE/gguf/$name" 2>/dev/null || true  # a missing part: the check below says so
        (cd "$SPECBENCH_CACHE/gguf" && sha256sum -c --quiet "$STASH/SHA256SUMS") || { echo "error: $name is incomplete: stash every .gpu/N part first, on the same machine" >&2; exit 1; }
    fi
fi

if [ "$rehearse" = 1 ]; then
    device=cpu t1=900 t2=1800 t3=2700 end=3600
    head=(--reps 1 --prompts 2 --ks 1 --batch-sizes --max-new-tokens 8 --memory-prompts 0)
    sweep=(batch_size=1,2 dataset.num_prompts=4 max_new_tokens=8 k=1)
    eager=(--reps 1 --prompts 2 --ks 1 --batch-sizes 2 --max-new-tokens 8 --memory-prompts 4 --memory-new-tokens 4)
    compiled=(--reps 1 --prompts 1 --ks 1 --batch-sizes --max-new-tokens 8 --memory-prompts 0)
    distilled=(--threads 2 --prompt-seeds 0 --temperatures 1.0 --max-prompts 6 --max-new-tokens 8 --gen-batch-size 4 --epochs 1 --eval-prompts 2 --eval-new-tokens 8)
else
    # Within a 10-minute limit per command, set-up included (SECONDS counts from this script's
    # start), with 30 s left to copy $OUT back: of the default 570 s the head's part runs until 170 s
    # at most, the batch sweep until 400 s, the model draft's part until 490 s, the compiled part until
    # the end (time a part leaves goes to the next). --seconds S scales the four, for a machine with less time left.
    # Sized for an H200 on which an eager bf16 step of the embedded target took 33-35 ms (a virtualised
    # machine: every kernel launch costs tens of microseconds there); a machine with faster launches finishes early.
    device=cuda end=$seconds t1=$((seconds * 170 / 570)) t2=$((seconds * 400 / 570)) t3=$((seconds * 490 / 570))
    $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA device: this script checks the GPU path (--rehearse runs it on the CPU)')"
    head=(--reps 2 --prompts 4 --ks 1 2 --batch-sizes --max-new-tokens 32 --memory-prompts 0)
    sweep=(batch_size=1,8 dataset.num_prompts=16 max_new_tokens=32 k=2)  # the smallest and a batch of 8, at one k
    eager=(--reps 2 --prompts 4 --ks 1 2 --batch-sizes 4 --max-new-tokens 32 --memory-prompts 100 --memory-new-tokens 16)
    compiled=(--reps 3 --prompts 6 --ks 1 2 4 --batch-sizes --max-new-tokens 32 --memory-prompts 0)  # batches run eager
    # 8 prompt seeds x 3 temperatures (7,524 sequences, about a million training positions), 4 epochs
    distilled=(--threads 8 --prompt-seeds 0 1 2 3 4 5 6 7 --temperatures 0 0.7 1.0 --gen-batch-size 256 --epochs 4 --lr 1.5e-3 --log-every 100)
fi
dir=${OUT:-results/bench}  # straight into $OUT when set: a command cut short still leaves what was written there
mkdir -p "$dir"
log=$dir/gpu_check.log  # one log for every part (a machine may send back only a few files)
: > "$log"
if [ "$rehearse" = 0 ]; then  # the GPU's driver and clocks, kept beside the JSON files
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv \
        | tee "$dir/nvidia-smi.csv" || true
fi
# left NAME UNTIL LEAST: the seconds a part may run, cut at UNTIL seconds into the script; none (returning 1)
# when fewer than LEAST are left for it.
left() {
    local left=$(($2 - SECONDS))
    if [ "$left" -lt "$3" ]; then
        echo "[gpu_check] ${SECONDS}s in: no time left for the $1 part (${left}s)" | tee -a "$log"; return 1
    fi
    echo "[gpu_check] ${SECONDS}s in: the $1 part gets ${left}s" | tee -a "$log"
    seconds_left=$left
}
# part NAME FILE UNTIL LEAST ARGS...: one bench run, written to $dir/FILE.json.
part() {
    local name=$1 file=$2; shift 2
    left "$name" "$1" "$2" || return 1
    shift 2
    timeout "$seconds_left" $PY -m harness.bench --out "$dir/$file.json" "$@" device=$device 2>&1 | tee -a "$log" || status=1
}
# sweep UNTIL LEAST ARGS...: python -m harness over the three embedded drafts, packed into $dir/gpu_batch_sweep.tar.gz
# (the cells a cut-off sweep finished are kept).
sweep() {
    left "batch sweep" "$1" "$2" || return 1
    shift 2
    local cells=$dir/gpu_batch_sweep
    rm -rf "$cells"
    timeout "$seconds_left" $PY -m harness -m "$@" +pair=smollm2_eagle,smollm2,smollm2_ngram temperature=0 device=$device \
        compile=true wandb.mode=disabled out_dir="$cells" hydra.sweep.dir="$cells/multirun" 2>&1 | tee -a "$log" || status=1
    if [ -d "$cells" ]; then tar -czf "$cells.tar.gz" -C "$dir" gpu_batch_sweep && rm -rf "$cells"; fi
}
status=0
if [ "$distill" = 1 ]; then  # the head distilled here, in the whole time (the data are sampled first: a cut run has them cached)
    $PY -c "from harness.models.embedded import embedded_model_dir; embedded_model_dir('smollm2')" 2>&1 | tee -a "$log" || exit 1
    left distill "$end" 120 || exit 1
    timeout "$seconds_left" $PY -m harness.distill --kind eagle3 --one-pass --device $device --out "$dir/smollm2_eagle" \
        --head-tokens 4096 --seed 0 "${distilled[@]}" 2>&1 | tee -a "$log" || status=1
    exit $status
fi
# The embedded target dequantised once (tens of seconds the first time), before any part's clock runs.
$PY -c "from harness.models.embedded import embedded_model_dir; embedded_model_dir('smollm2')" 2>&1 | tee -a "$log" || exit 1
part head gpu_head "$t1" 45 "${head[@]}" +pair=smollm2_eagle compile=true || exit 1  # the lean forward and head, captured
sweep "$t2" 60 "${sweep[@]}" || exit 1
part eager gpu_eager "$t3" 60 "${eager[@]}" +pair=smollm2 forward=hf || exit 1
part compiled gpu_static_compile "$end" 60 "${compiled[@]}" +pair=smollm2 cache=static compile=true forward=hf || exit $status
exit $status
