#!/usr/bin/env bash
# The performance check on one GPU, in one command (under 10 minutes on one H200):
#   bash scripts/gpu_check.sh            # writes results/bench/gpu_*.json and prints the figures
# Runs harness.bench on the embedded default pair (offline: no hub access needed)
#   1. eager, dynamic cache: ours vs HF generate / assisted / prompt lookup, efficiency,
#      overhead, memory over 100 prompts, and the host syncs per cycle;
#   2. static cache + torch.compile of both models, against HF generate's own compiled
#      path (static cache + compile_config): throughput, efficiency and overhead.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=disabled HF_HUB_OFFLINE=1
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA device: this script checks the GPU path')"
timeout 330 python -m harness.bench --reps 5 --prompts 6 --ks 1 2 4 --memory-prompts 100 \
    --out results/bench/gpu_eager.json device=cuda
timeout 240 python -m harness.bench --reps 3 --prompts 6 --ks 1 2 4 --memory-prompts 0 \
    --out results/bench/gpu_static_compile.json device=cuda cache=static compile=true
