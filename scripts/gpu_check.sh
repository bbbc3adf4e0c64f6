#!/usr/bin/env bash
# The performance check on a machine with a GPU, in one command (it stops within 330 s of its start, set-up included:
# a 6-minute command on one H100 or H200, with time to copy the results back):
#   bash scripts/gpu_check.sh            # writes results/bench/gpu_* ($OUT/ when set) and prints the figures
# It runs on the shape pairs (conf/pair/shapes_*.yaml: published architectures built with random weights on
# the device; nothing downloaded, no GGUF). Their runs are cost-only: the target's step time, the draft's
# cost c, the verify cost v(n), limit_ratio (the step time against the bytes a step reads over the measured
# bandwidth) and a grid of predicted speedups over acceptance and k (acceptance between random models means nothing):
#   1. target: python -m harness on +pair=shapes_llama31_8b_1b, k=1, batch_size 1, 8 and 32, eager and
#      compiled (compile=false,true; 32 builtin prompts x 16 tokens, greedy): the 8B target's step time and
#      limit_ratio, packed as gpu_shapes_target.tar.gz;
#   2. pairs: python -m harness on the Llama-2-7B/68M, Llama-3.1-8B/1B and Llama-3.1-8B/EAGLE-3 shape pairs,
#      compiled, k=4, batch_size 1 and 8 (8 prompts x 16 tokens): c and v(n), whose predicted grid covers
#      k = 1..4, packed as gpu_shapes_pairs.tar.gz;
#   3. bench: harness.bench on shapes_llama2_7b_68m: our loop against HF generate() with assistant_model
#      (the same random weights, greedy: the same output), k = 1, 2, 4, written to gpu_shapes_bench.json.
# Of the default 330 s the target part runs until 45% of the time at most, the pairs until 80%, the bench until
# the end (time a part leaves goes to the next; --seconds S scales them, at least 120). Each part writes into the
# results folder as it goes (a sweep's finished cells, the bench after every repetition), so a command cut short
# still leaves every finished part there. Beside them: versions.txt (Python, torch, CUDA, the libraries),
# nvidia-smi.csv (the GPU, driver and clocks at the start), nvidia-smi-run.csv (clocks, power and load every
# 5 s while the parts run), nvidia-smi-end.csv (the same at the end) and one log of every part, gpu_check.log.
#
# --embedded runs the embedded SmolLM2 pairs instead (they need the embedded model's GGUF file), in 570 s by default:
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
# $OUT/smollm2_eagle (config.json, model.safetensors, harness_head.json) with its log; 570 s by default.
#
# On a GPU machine without network access that receives at most 64 MiB of files per command, the working
# tree included, scripts/gpu_payload.sh packs the packages it lacks into .gpu/1 (site.tar.xz: the wheels'
# files, extracted into /tmp/specbench-site here and put on PYTHONPATH), and with --embedded the GGUF file
# into .gpu/2 ... .gpu/N:
#   bash scripts/gpu_check.sh --stash .gpu/1 --run                 # the shape pairs: one command
#   bash scripts/gpu_check.sh --stash .gpu/i                       # --embedded: keep each part but the last on the machine,
#   bash scripts/gpu_check.sh --stash .gpu/N --run --embedded      # then the last: install, assemble, run
# --rehearse runs the same steps on the CPU with tiny sizes, to test this script without a GPU.
# PYTHON names the interpreter (default python3); every part runs as $PYTHON -m harness or $PYTHON -m harness.bench.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STASH=${SPECBENCH_PAYLOAD:-/tmp/specbench-payload}
SITE=${SPECBENCH_SITE:-/tmp/specbench-site}  # where a payload's packages are unpacked
usage="usage: bash scripts/gpu_check.sh [--stash DIR [--run]] [--seconds S] [--rehearse] [--embedded | --distill]"
stash="" run=1 rehearse=0 seconds="" mode=shapes
while [ $# -gt 0 ]; do
    case "$1" in
        --stash) stash=$2; run=0; shift 2 ;;
        --run) run=1; shift ;;
        --rehearse) rehearse=1; shift ;;
        --embedded|--distill)
            [ "$mode" = shapes ] || { echo "error: give one of --embedded and --distill" >&2; exit 2; }
            mode=${1#--}; shift ;;
        --seconds) seconds=$2; shift 2 ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
done
case "$mode" in
    shapes) default=330 least=120 what="shape-pair check" ;;
    embedded) default=570 least=180 what="embedded check" ;;
    distill) default=570 least=180 what="distillation" ;;
esac
seconds=${seconds:-$default}
case "$seconds" in
    ''|*[!0-9]*) echo "error: --seconds $seconds: give a whole number of seconds ($default fits the $what in one command)" >&2; exit 2 ;;
esac
seconds=$((10#$seconds))  # decimal, also with a leading zero (bash reads 0300 as octal)
if [ "$seconds" -lt "$least" ]; then
    echo "error: --seconds $seconds: the $what needs at least $least s (set-up, then each of its parts)" >&2; exit 2
fi

# versions: the interpreter's, torch's and CUDA's, and each library's with the folder it is imported from.
versions() {
    $PY - <<'EOF'
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "-"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "-"
    print("torch", torch.__version__, "| CUDA", torch.version.cuda or "-", "| cuDNN", cudnn, "| GPU", gpu)
except Exception as e:  # the check says so again where it needs torch
    print("torch: not importable:", e)
names = "transformers tokenizers huggingface-hub safetensors accelerate triton numpy scipy pandas pyarrow hydra-core omegaconf antlr4-python3-runtime gguf datasets dill multiprocess pyyaml wandb".split()
for name in names:
    try:
        dist = md.distribution(name)
        print(name, dist.version, dist.locate_file(""))
    except md.PackageNotFoundError:
        print(name, "-")
EOF
}

if [ -n "$stash" ]; then
    mkdir -p "$STASH" && cp -r "$stash"/. "$STASH"/
    echo "stashed $(du -sb "$stash" | cut -f1) bytes from $stash; $STASH now holds:"; ls -R "$STASH" | sed 's/^/  /'
    if [ "$run" = 0 ]; then  # the machine's own packages and GPU, before the last part arrives
        versions || true
        command -v nvidia-smi >/dev/null && nvidia-smi -L || true
    fi
fi
[ "$run" = 1 ] || exit 0

if [ -f "$STASH/COMMIT" ]; then  # the commit the payload was packed at (harness.runner.cell.harness_commit), also where a stale .git came along
    export SPECBENCH_COMMIT=$(cat "$STASH/COMMIT")
fi
if [ -d "$STASH" ]; then  # a payload was stashed: unpack its packages, and for the embedded pairs assemble the GGUF file
    if [ -f "$STASH/site.tar.xz" ] || compgen -G "$STASH/wheels/*.whl" >/dev/null; then
        rm -rf "$SITE" && mkdir -p "$SITE"
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}  # before the machine's own site-packages
    fi
    if [ -f "$STASH/site.tar.xz" ]; then  # the wheels' files, as pip install --target lays them out
        $PY -c 'import sys, tarfile
with tarfile.open(sys.argv[1]) as site:
    site.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' "$STASH/site.tar.xz" "$SITE"
        echo "unpacked $STASH/site.tar.xz into $SITE"
    fi
    if compgen -G "$STASH/wheels/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STASH"/wheels/*.whl
    fi
    if [ "$mode" != shapes ]; then
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
fi

if [ "$rehearse" = 1 ]; then
    device=cpu
    # One thread a process: two threads on a busy 2-core machine (a test suite beside it) wait on each other
    # at every operator, and a tiny step then takes 50 times longer.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    device=cuda
    $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA device: this script checks the GPU path (--rehearse runs it on the CPU)')"
fi
if [ "$mode" = shapes ] && [ "$rehearse" = 1 ]; then
    # Not timed: the deadlines only stop a hung step. Tiny widths on every role (config overrides), so that
    # the three parts run on 2 CPU cores in about a minute; cpu_linear=torch: no probe of the CPU's linear
    # plans for each new shape (seconds each, minutes on a busy machine).
    t1=900 t2=1800 end=2700
    tiny=(cpu_linear=torch) tiny_pairs=(cpu_linear=torch)
    for role in target draft; do
        c=++pair.$role.config
        tiny+=("$c.hidden_size=64" "$c.intermediate_size=128" "$c.num_hidden_layers=2" "$c.num_attention_heads=4" "$c.num_key_value_heads=4" "$c.vocab_size=512")
        # The pairs' sweep holds the EAGLE-3 head, which reads the target's layers 2, L/2 and L-3 (3 layers at
        # least) and proposes from draft_vocab_size (32000) of the target's tokens: a model draft has no
        # draft_vocab_size to shrink in the same sweep, so the vocabulary stays at 32000 there.
        layers=$([ "$role" = target ] && echo 3 || echo 2)
        tiny_pairs+=("$c.hidden_size=64" "$c.intermediate_size=128" "$c.num_hidden_layers=$layers" "$c.num_attention_heads=4" "$c.num_key_value_heads=4" "$c.vocab_size=32000")
    done
    target=(k=1 batch_size=1,2 compile=false,true dataset.num_prompts=2 max_new_tokens=4 "${tiny[@]}")
    # Eager here: compiling the sweep's six cells would double the rehearsal, and the target part rehearses compile=true.
    pairs=(k=2 batch_size=1,2 compile=false dataset.num_prompts=2 max_new_tokens=4 "${tiny_pairs[@]}")
    bench=(--reps 1 --prompts 2 --ks 1 --batch-sizes --max-new-tokens 8 --memory-prompts 0 "${tiny[@]}")
elif [ "$mode" = shapes ]; then
    # Within 6 minutes per command, set-up included (SECONDS counts from this script's start), with time left
    # to copy $OUT back: of the default 330 s the target part runs until 148 s at most, the pairs until 264 s,
    # the bench until the end.
    end=$seconds t1=$((seconds * 45 / 100)) t2=$((seconds * 80 / 100))
    target=(k=1 batch_size=1,8,32 compile=false,true dataset.num_prompts=32 max_new_tokens=16)
    pairs=(k=4 batch_size=1,8 compile=true dataset.num_prompts=8 max_new_tokens=16)
    bench=(--reps 2 --prompts 4 --ks 1 2 4 --batch-sizes --max-new-tokens 32 --memory-prompts 0)
elif [ "$rehearse" = 1 ]; then
    t1=900 t2=1800 t3=2700 end=3600
    head=(--reps 1 --prompts 2 --ks 1 --batch-sizes --max-new-tokens 8 --memory-prompts 0)
    sweep=(batch_size=1,2 dataset.num_prompts=4 max_new_tokens=8 k=1)
    eager=(--reps 1 --prompts 2 --ks 1 --batch-sizes 2 --max-new-tokens 8 --memory-prompts 4 --memory-new-tokens 4)
    compiled=(--reps 1 --prompts 1 --ks 1 --batch-sizes --max-new-tokens 8 --memory-prompts 0)
    distilled=(--threads 2 --prompt-seeds 0 --temperatures 1.0 --max-prompts 6 --max-new-tokens 8 --gen-batch-size 4 --epochs 1 --eval-prompts 2 --eval-new-tokens 8)
else
    # Within a 10-minute limit per command, set-up included, with 30 s left to copy $OUT back: of the default
    # 570 s the head's part runs until 170 s at most, the batch sweep until 400 s, the model draft's part until
    # 490 s, the compiled part until the end. Sized for an H200 on which an eager bf16 step of the embedded
    # target took 33-35 ms (a virtualised machine: every kernel launch costs tens of microseconds there);
    # a machine with faster launches finishes early.
    end=$seconds t1=$((seconds * 170 / 570)) t2=$((seconds * 400 / 570)) t3=$((seconds * 490 / 570))
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
versions > "$dir/versions.txt" 2>&1 || true
tee -a "$log" < "$dir/versions.txt"
sampler="" clocks=timestamp,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used
if [ "$rehearse" = 0 ] && command -v nvidia-smi >/dev/null; then  # the GPU's driver and clocks, kept beside the results
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$dir/nvidia-smi.csv" || true
    nvidia-smi --query-gpu=$clocks --format=csv -l 5 > "$dir/nvidia-smi-run.csv" 2>&1 &  # while the parts run
    sampler=$!
fi
# At the exit, also a cut or failed one: the sampler stopped, and the clocks the run left the GPU at.
finish() {
    [ -z "$sampler" ] || kill "$sampler" 2>/dev/null || true
    if [ "$rehearse" = 0 ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,$clocks --format=csv > "$dir/nvidia-smi-end.csv" 2>&1 || true
    fi
    echo "[gpu_check] ${SECONDS}s in: done; $dir holds:" && ls -l "$dir" | sed 's/^/  /' || true
}
trap finish EXIT
# left NAME UNTIL LEAST: the seconds a part may run, cut at UNTIL seconds into the script (SIGTERM, then SIGKILL
# 10 s later if it is still running); none (returning 1) when fewer than LEAST are left for it.
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
    timeout -k 10 "$seconds_left" $PY -m harness.bench --out "$dir/$file.json" "$@" device=$device 2>&1 | tee -a "$log" || status=1
}
# sweep NAME FILE UNTIL LEAST ARGS...: python -m harness -m ARGS, its cells written into $dir/FILE and packed
# into $dir/FILE.tar.gz (the cells a cut-off sweep finished are kept).
sweep() {
    local name=$1 file=$2; shift 2
    left "$name" "$1" "$2" || return 1
    shift 2
    local cells=$dir/$file
    rm -rf "$cells"
    timeout -k 10 "$seconds_left" $PY -m harness -m "$@" temperature=0 device=$device \
        wandb.mode=disabled out_dir="$cells" hydra.sweep.dir="$cells/multirun" 2>&1 | tee -a "$log" || status=1
    if [ -d "$cells" ]; then tar -czf "$cells.tar.gz" -C "$dir" "$file" && rm -rf "$cells"; fi
}
status=0
if [ "$mode" = shapes ]; then  # each part on its own: one refused or out of time leaves the others to run
    sweep target gpu_shapes_target "$t1" 30 +pair=shapes_llama31_8b_1b "${target[@]}" || status=1
    sweep pairs gpu_shapes_pairs "$t2" 30 +pair=shapes_llama2_7b_68m,shapes_llama31_8b_1b,shapes_llama31_8b_eagle3 "${pairs[@]}" || status=1
    part bench gpu_shapes_bench "$end" 20 "${bench[@]}" +pair=shapes_llama2_7b_68m || status=1
    exit $status
fi
if [ "$mode" = distill ]; then  # the head distilled here, in the whole time (the data are sampled first: a cut run has them cached)
    $PY -c "from harness.models.embedded import embedded_model_dir; embedded_model_dir('smollm2')" 2>&1 | tee -a "$log" || exit 1
    left distill "$end" 120 || exit 1
    timeout -k 10 "$seconds_left" $PY -m harness.distill --kind eagle3 --one-pass --device $device --out "$dir/smollm2_eagle" \
        --head-tokens 4096 --seed 0 "${distilled[@]}" 2>&1 | tee -a "$log" || status=1
    exit $status
fi
# The embedded target dequantised once (tens of seconds the first time), before any part's clock runs.
$PY -c "from harness.models.embedded import embedded_model_dir; embedded_model_dir('smollm2')" 2>&1 | tee -a "$log" || exit 1
part head gpu_head "$t1" 45 "${head[@]}" +pair=smollm2_eagle compile=true || exit 1  # the lean forward and head, captured
sweep "batch sweep" gpu_batch_sweep "$t2" 60 "${sweep[@]}" +pair=smollm2_eagle,smollm2,smollm2_ngram compile=true || exit 1
part eager gpu_eager "$t3" 60 "${eager[@]}" +pair=smollm2 forward=hf || exit 1
part compiled gpu_static_compile "$end" 60 "${compiled[@]}" +pair=smollm2 cache=static compile=true forward=hf || exit $status
exit $status
