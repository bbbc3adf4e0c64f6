"""Distil the embedded default draft for SmolLM2-135M-Instruct.

    python -m harness.distill --out harness/assets/smollm2_draft --layers 4 --head-tokens 8192 --seed 0

The draft (see harness.models.shared_draft) is a few Llama layers on top of the
target's own embedding table, with an LM head restricted to S tokens whose
rows are copies of the target's (tied) embedding rows. Only the layers and
the final norm are trained; the embedding and the head rows stay frozen, so
only the layers and the norm need storing.

Method, step by step:

1. Training prompts are generated from templates and topic lists
   (harness/distill/prompts.json, read by harness.distill.data), covering
   the six kinds of task of the evaluation set (conversation, translation,
   summarization, qa, math, code) with different text. The
   evaluation prompts (harness/data/builtin_prompts.jsonl) are never used
   for training; training prompts sharing 10 words in a row with one of
   them are left out. Prompts are formatted with the target's chat
   template, generation prompt included. With --one-pass, --prompt-seeds
   makes the list once per seed (other templates, languages and numbers).
2. Data: continuations sampled from the target itself (batched
   `generate`, left padding; one per prompt at each of `--temperatures`,
   up to 128 new tokens each), so the draft learns the target's own text.
   --one-pass (feature heads; harness.distill.one_pass) samples with the
   lean forward on --device and keeps step 3's teacher and the target's
   features from the same forwards, so no second pass runs.
3. Teacher: one full forward of the target over each prompt+continuation;
   at every training position (from the first user-message token on: the
   fixed system preamble is skipped) its next-token distribution at
   temperature 1 is kept compactly as the top-k probabilities and ids in
   fp16/int32. Continuation positions have weight 1, prompt positions
   `--prompt-weight`.
4. Head subset: the S tokens with the most target probability mass over
   the training positions (summed over the stored top-k, weighted as in the
   loss), always including the chat special tokens and every whitespace
   token holding a newline.
5. Student: `--layers` layers initialised from target layers (default: the
   first half and the last half of the stack, e.g. 0, 1, 28, 29), trained
   with AdamW, warmup then cosine decay, on
       -sum_{v in S} p(v) log q(v)  +  top1_weight * -log q(argmax p)
   (forward KL to the teacher restricted to the head, plus a top-1 term
   that helps greedy agreement; the top-1 term is dropped where the
   teacher's argmax is outside S).
6. Held-out evaluation on target continuations of the 60 builtin prompts
   (greedy and sampled at T=1 with a fixed seed, 64 new tokens):
   (a) T=0 agreement: fraction of continuation positions where the draft's
       argmax equals the target's;
   (b) T=1: mean sum_v min(p(v), q(v)), the expected acceptance of one
       drafted token.
   The numbers are computed on the weights as stored (rounded to fp16).
7. The draft is saved with `save_shared_draft`, with the command line,
   arguments, data size, timings, evaluation and library versions in
   harness_draft.json.

Generated data (tokens and teacher top-k) is cached under
<cache>/specbench-harness/distill/, keyed by everything it depends on, so a
rerun skips generation. Everything is seeded: on the same machine, library
versions and thread count, the command reproduces the weights.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import transformers

from harness.distill.data import build_eval_data, build_training_data
from harness.distill.train import choose_head, default_init_layers, evaluate, train
from harness.models.embedded import embedded_model_dir
from harness.models.shared_draft import build_shared_draft, save_shared_draft


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m harness.distill",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--out", type=Path, required=True, help="output directory of the draft")
    ap.add_argument(
        "--kind",
        choices=["shared", "eagle3"],
        default="shared",
        help="shared: a few layers over the target's embeddings (harness.models.shared_draft); eagle3: a feature head",
    )
    ap.add_argument("--ttt-steps", type=int, default=3, help="eagle3: drafting steps unrolled in training")
    ap.add_argument("--target", default="smollm2", help="embedded target name")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--init-layers",
        type=int,
        nargs="+",
        default=None,
        help="target layers to copy (default: first half and last half of the stack)",
    )
    ap.add_argument("--head-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    # data
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[1.0, 0.7],
        help="one continuation of every training prompt per temperature",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompts", type=int, default=0, help="use only this many training prompts (0: all)")
    ap.add_argument("--gen-batch-size", type=int, default=32)
    ap.add_argument("--teacher-batch-size", type=int, default=8)
    ap.add_argument("--topk", type=int, default=64, help="teacher probabilities kept per position")
    ap.add_argument("--prompt-weight", type=float, default=0.5, help="loss weight of prompt positions")
    ap.add_argument("--no-cache", action="store_true", help="regenerate the data even if cached")
    ap.add_argument("--data-only", action="store_true", help="only generate (and cache) the data")
    ap.add_argument(
        "--one-pass",
        action="store_true",
        help="eagle3: sample the continuations with the lean forward, keeping the teacher's top-k and the features of the same pass",
    )
    ap.add_argument(
        "--prompt-seeds",
        type=int,
        nargs="+",
        default=None,
        help="--one-pass: the training prompts made with each of these seeds (templates, languages, numbers; default: --seed)",
    )
    ap.add_argument("--device", default="cpu", help="--one-pass: where the target samples the data (cpu, cuda)")
    # training
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--top1-weight", type=float, default=0.2)
    ap.add_argument("--max-steps", type=int, default=0, help="stop training after this many steps (0: no limit)")
    ap.add_argument("--log-every", type=int, default=25)
    # evaluation
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--eval-seed", type=int, default=1234)
    ap.add_argument("--eval-prompts", type=int, default=0, help="use only this many evaluation prompts (0: all 60)")
    ap.add_argument("--skip-baseline", action="store_true", help="do not evaluate the untrained draft")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if (args.prompt_seeds or args.device != "cpu") and not args.one_pass:
        raise SystemExit("--prompt-seeds and --device apply to --one-pass data only: add --one-pass")
    if args.one_pass and args.kind != "eagle3":
        raise SystemExit("--one-pass makes the data of feature heads: use it with --kind eagle3")
    command = "python -m harness.distill " + shlex.join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.models.loading import PLAIN

    model_dir = embedded_model_dir(args.target)
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **PLAIN).eval()
    target.requires_grad_(False)
    init_layers = args.init_layers or default_init_layers(args.layers, target.config.num_hidden_layers)
    assert len(init_layers) == args.layers, "--init-layers must name --layers layers"

    print(f"[distill] training data ({args.temperatures}, {args.max_new_tokens} new tokens) ...", flush=True)
    if args.one_pass:
        from harness.distill.head import reads
        from harness.distill.one_pass import build_one_pass_data

        sampler = target.to(args.device)
        data = build_one_pass_data(args, sampler, tok, model_dir, reads(target))
        target = sampler.to("cpu")
        if args.device != "cpu":  # the lean forward's fused weights are of the device copy
            del target._harness_lean_fused, target.fused_linear_weights
    else:
        data = build_training_data(args, target, tok, model_dir)
    positions = sum(len(p) for p in data["probs"])
    print(
        f"[distill] {data['num_prompts']} prompts, {len(data['seqs'])} sequences, {data['generated_tokens']} "
        f"generated tokens, {positions} training positions (generation {data['gen_time_s']:.0f}s, "
        f"teacher {data['teacher_time_s']:.0f}s)",
        flush=True,
    )
    print("[distill] evaluation data ...", flush=True)
    eval_data = build_eval_data(args, target, tok, model_dir)
    if args.data_only:
        print(f"[distill] data ready ({time.time() - started:.0f}s); --data-only: stopping here", flush=True)
        return

    head_ids = choose_head(tok, data["mass"], args.head_tokens)
    weighted = sum(w.sum().item() for w in data["weights"])
    coverage = data["mass"][head_ids].sum().item() / weighted
    print(f"[distill] head: {head_ids.numel()} tokens covering {coverage:.4f} of the teacher mass", flush=True)
    if args.kind == "eagle3":
        from harness.distill.head_main import distil_head

        return distil_head(args, command, started, target, data, eval_data, head_ids, coverage)
    torch.manual_seed(args.seed)
    draft = build_shared_draft(target, args.layers, head_ids, init_layers)
    baseline = None
    if not args.skip_baseline:
        baseline = evaluate(target, draft.eval(), eval_data)
        print(
            f"[distill] untrained (layers {init_layers}): T=0 agreement {baseline['t0_agreement']:.3f}, "
            f"T=1 sum min(p,q) {baseline['t1_sum_min_pq']:.3f}",
            flush=True,
        )

    print(f"[distill] training {args.layers} layers initialised from {init_layers} ...", flush=True)
    training = train(args, draft, data, head_ids)
    # Evaluate exactly what is stored: the trained weights rounded to fp16.
    with torch.no_grad():
        for m in (draft.model.layers, draft.model.norm):
            for p in m.parameters():
                p.copy_(p.half().float())
    result = evaluate(target, draft, eval_data)
    print(
        f"[distill] held-out: T=0 agreement {result['t0_agreement']:.3f}, T=1 sum min(p,q) {result['t1_sum_min_pq']:.3f}",
        flush=True,
    )
    print(f"  by category T=0: {json.dumps({k: round(v, 3) for k, v in result['t0_agreement_by_category'].items()})}")
    print(f"  by category T=1: {json.dumps({k: round(v, 3) for k, v in result['t1_sum_min_pq_by_category'].items()})}")

    meta = {
        "made_by": "harness.distill",
        "command": command,
        "seed": args.seed,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target": f"embedded:{args.target}",
        "init_layers": init_layers,
        "head_tokens": int(head_ids.numel()),
        "head_teacher_mass_coverage": coverage,
        "data": {
            "training_prompts": data["num_prompts"],
            "sequences": len(data["seqs"]),
            "generated_tokens": data["generated_tokens"],
            "training_positions": positions,
            "generation_time_s": round(data["gen_time_s"], 1),
            "teacher_time_s": round(data["teacher_time_s"], 1),
        },
        "training": {**training, "train_time_s": round(training["train_time_s"], 1)},
        "eval": {
            "prompts": len(eval_data["prompt_ids"]),
            "new_tokens": args.eval_new_tokens,
            "seed": args.eval_seed,
            **result,
            "untrained": baseline,
        },
        "total_time_s": round(time.time() - started, 1),
        "versions": {
            "torch": str(torch.__version__),
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "threads": args.threads,
    }
    save_shared_draft(draft, args.out, meta)
    size = (args.out / "weights.safetensors").stat().st_size
    print(f"[distill] saved {args.out} ({size / 1e6:.1f} MB weights) in {meta['total_time_s']:.0f}s total", flush=True)


def cli() -> None:
    """`python -m harness.distill`."""
    main()
