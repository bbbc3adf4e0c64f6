"""`python -m harness.distill --kind eagle3`: the feature head's part of the distillation command.

    python -m harness.distill --kind eagle3 --out harness/assets/smollm2_eagle --head-tokens 4096 --seed 0

Same data as the shared-weights draft (harness.distill.main's steps 1-4: training prompts that share
no long word sequence with the builtin ones, the target's continuations, the teacher's top-k, the
draft vocabulary of the tokens with the most teacher mass), plus the target's features; the head is
trained by harness.distill.head and evaluated after each epoch on the target's greedy continuations
of the builtin prompts (held out). Stored in the EAGLE-3 layout with fp16 weights, as evaluated.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch
import transformers

from harness.distill.head import cached_features, held_out, new_head, reads, save_head, train_head


def distil_head(args, command: str, started: float, target, data: dict, eval_data: dict, vocab_ids, coverage: float) -> None:
    torch.manual_seed(args.seed)
    layers = reads(target)
    target = target.to(args.device)  # --device: the head trains and is evaluated there
    head = new_head(target, vocab_ids).float().to(args.device)
    feats = data.get("feats") or cached_features(
        target, data, layers, {"data": data.get("key", ""), "seqs": sum(len(s) for s in data["seqs"])}
    )
    head.train()
    for p in head.parameters():
        p.requires_grad_(True)

    def evaluate(trained):  # after each epoch, on the float32 weights
        trained.eval()
        result = held_out(trained, target, eval_data, layers, args.ttt_steps)
        trained.train()
        return result

    untrained = held_out(head.eval(), target, eval_data, layers, args.ttt_steps)
    print(f"[distill] untrained head: held-out {untrained}", flush=True)
    head.train()
    training = train_head(head, data, feats, args, evaluate)
    head.eval()
    with torch.no_grad():  # evaluate exactly what is stored: the weights rounded to fp16
        for p in head.parameters():
            p.copy_(p.half().float())
    result = held_out(head, target, eval_data, layers, args.ttt_steps)
    print(f"[distill] held-out (fp16 weights): {result}", flush=True)
    meta = {
        "format": 1,
        "made_by": "harness.distill",
        "command": command,
        "seed": args.seed,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target": f"embedded:{args.target}",
        "layout": "eagle3",
        "reads_target_layers": list(layers),
        "draft_vocab": int(vocab_ids.numel()),
        "draft_vocab_teacher_mass_coverage": coverage,
        "params": sum(p.numel() for p in head.parameters()),
        "data": {
            "training_prompts": data["num_prompts"],
            "sequences": len(data["seqs"]),
            "generated_tokens": data["generated_tokens"],
            "training_positions": sum(len(p) for p in data["probs"]),
        },
        "training": training,
        "eval": {"prompts": len(eval_data["prompt_ids"]), **result, "untrained": untrained},
        "total_time_s": round(time.time() - started, 1),
        "versions": {
            "torch": str(torch.__version__),
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "threads": torch.get_num_threads(),
    }
    save_head(head.cpu(), args.out, meta)
    size = (args.out / "model.safetensors").stat().st_size
    print(f"[distill] saved {args.out} ({size / 1e6:.1f} MB) in {meta['total_time_s']:.0f}s total", flush=True)
