"""Train an EAGLE-3 feature head for a target (harness.models.eagle), on the target's own text.

Data: the distillation sequences of harness.distill.data (the target's continuations of the
training prompts, never the builtin ones) with the teacher's top-k next-token distributions,
plus the target's features at every position (the inputs of layers 2, L/2 and L-3), from one
forward per sequence, cached on disk.

Training-time test: a head drafts k tokens in a row, the first from the target's features, the
later ones from its own outputs, attending to the pairs before them as its KV cache holds them
while drafting. Training unrolls `steps` such drafting steps over every position at once. At step
s the pair at position i reads its own output of step s-1 at position i-1 (the target's features
at step 1) and the committed token i + 1, and attends to the step-1 pairs at positions <= i-s+1
and to the step-s' pair at position i-(s-s') for each later step s' <= s: exactly the cache of a
drafter whose first draft came from pair i-s+1. Every step is scored against the teacher's
distribution of token i + 2, restricted to the head's draft vocabulary (forward KL).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from harness.base.files import cache_root
from harness.models.eagle import FeatureHead, eagle3_layers


def head_config(target, draft_vocab: int) -> LlamaConfig:
    """The head's config: the target's attention and MLP shapes, one layer, a draft vocabulary of its own."""
    t = target.config.get_text_config(decoder=True)
    fields = {
        key: getattr(t, key)
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "vocab_size",
            "bos_token_id",
            "eos_token_id",
            "hidden_act",
        )
    }
    rope = getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(t, "rope_theta", 10000.0)}
    return LlamaConfig(
        **fields,
        num_hidden_layers=1,
        draft_vocab_size=draft_vocab,
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle3"],
    )


def new_head(target, vocab_ids: torch.Tensor) -> FeatureHead:
    """An EAGLE-3 head over the target tokens `vocab_ids` (sorted), initialised from the target: the
    attention's hidden-state half, its output, the MLP and its norm from the last layer, the LM head
    rows from the target's, fc reading the late feature."""
    config = head_config(target, vocab_ids.numel())
    H = config.hidden_size
    head = FeatureHead("eagle3", config, target, H)
    last = target.get_decoder().layers[-1]
    layer = head.midlayer
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            ours, theirs = getattr(layer.self_attn, name).weight, getattr(last.self_attn, name).weight
            ours[:, :H].normal_(0.0, 0.02)
            ours[:, H:] = theirs
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        head.norm.weight.copy_(target.get_decoder().norm.weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab_ids])
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H :] = torch.eye(H)
        head.d2t.copy_(vocab_ids - torch.arange(vocab_ids.numel()))
        head.t2d.zero_()
        head.t2d[vocab_ids] = True
    return head


@torch.inference_mode()
def features(target, seqs: list[list[int]], layers: tuple[int, ...], batch_size: int = 8) -> list[torch.Tensor]:
    """Per sequence, the target's features [len - 1, len(layers) * H] (fp16) at positions 0..len-2."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    device = next(target.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for first in range(0, len(order), batch_size):
        idx = order[first : first + batch_size]
        width = max(len(seqs[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long, device=device)
        for row, i in enumerate(idx):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        states = target.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states  # right padding: causal
        both = torch.cat([states[layer] for layer in layers], dim=-1)  # [B, width, F]
        for row, i in enumerate(idx):
            out[i] = both[row, : len(seqs[i]) - 1].half()
    return out  # type: ignore[return-value]


def cached_features(target, data: dict, layers, key: dict) -> list[torch.Tensor]:
    payload = json.dumps({**key, "layers": list(layers), "sequences": len(data["seqs"])}, sort_keys=True)
    path = cache_root() / "distill" / f"features-{hashlib.sha256(payload.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        return torch.load(path)
    started = time.time()
    feats = features(target, data["seqs"], layers)
    print(f"[distill] target features of {len(feats)} sequences in {time.time() - started:.0f}s", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(feats, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return feats


def unrolled(head: FeatureHead, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs [..., n, H] at each of `steps` drafting steps over pairs 0..n-1 (tokens [..., n]: token i + 1
    of pair i; feats [..., n, F]: the target's at position i), for one sequence or a batch of right-padded ones
    (a pair never attends to a later one, so padding after a sequence leaves its outputs as they are alone).
    Row i of step s is meaningful for i >= s - 1."""
    if tokens.dim() == 1:  # one sequence: a batch of one
        return [out[0] for out in unrolled(head, tokens[None], feats[None], steps)]
    n = tokens.shape[-1]
    index = torch.arange(n, device=tokens.device)
    positions = index.expand(tokens.shape)
    hidden = head.fuse(feats.float())  # [..., n, H]
    keys, values, outs = [], [], []
    for s in range(1, steps + 1):
        h, residual = head.attention_input(tokens, hidden)
        q, k, v = head.qkv(h, positions)  # [..., heads, n, D], [..., kv, n, D], [..., kv, n, D]
        keys.append(k)
        values.append(v)
        # query i: step-1 keys at j <= i - s + 1; step-s' keys (s' >= 2) at j == i - (s - s')
        i, j = index[:, None], index[None, :]
        blocks = [j <= i - s + 1] + [j == i - (s - later) for later in range(2, s + 1)]
        mask = torch.cat(blocks, dim=1)  # [n, s * n]
        mask[:, 0] |= ~mask.any(dim=1)  # rows before s - 1 see nothing: any key, unscored
        attended = F.scaled_dot_product_attention(
            q, torch.cat(keys, dim=-2), torch.cat(values, dim=-2), attn_mask=mask, enable_gqa=True
        )
        out = head.finish(residual, attended)  # [..., n, H]
        outs.append(out)
        hidden = torch.cat(
            [out[..., :1, :], out[..., :-1, :]], dim=-2
        )  # pair i of the next step reads this step's output at i - 1
    return outs


def head_loss(head: FeatureHead, outs, probs, ids, weights, first: int, to_draft: torch.Tensor):
    """Forward KL to the teacher over the draft vocabulary, per step, over pairs first.. (pair i scores token i + 2,
    the teacher's row i - first); (loss, [per-step top-1 agreement with the teacher])."""
    rows = probs.shape[0]
    target_draft = to_draft[ids.long()]  # [rows, topk] draft index, -1 outside
    present = target_draft >= 0
    p = torch.where(present, probs.float(), 0.0)
    total, agree = 0.0, []
    for s, out in enumerate(outs, start=1):
        lo = max(first, s - 1)
        sl = slice(lo, first + rows)
        logq = head.lm_head(head.norm(out[sl])).log_softmax(-1)  # [m, Vd]
        t = slice(lo - first, rows)
        picked = logq.gather(1, target_draft[t].clamp(min=0))  # [m, topk]
        loss = -(p[t] * picked).sum(-1)  # [m]
        total = total + (loss * weights[t]).sum() / weights[t].sum().clamp(min=1e-6)
        best = ids[t, 0].long()
        agree.append((head.to_target_ids()[logq.argmax(-1)] == best).float().mean().item())
    return total / len(outs), agree


def train_head(head: FeatureHead, data: dict, feats: list[torch.Tensor], args, evaluate=None) -> dict:
    """AdamW with warmup and cosine decay over the sequences, `args.batch_size` sequences a step, on the head's device."""
    device = head.d2t.device
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    to_draft = torch.full((head.target_vocab,), -1, dtype=torch.long, device=device)
    to_draft[head.to_target_ids()] = torch.arange(head.draft_vocab, device=device)
    n = len(data["seqs"])
    per_epoch = math.ceil(n / args.batch_size)
    total = per_epoch * args.epochs if not args.max_steps else min(per_epoch * args.epochs, args.max_steps)
    warmup = min(args.warmup, total // 10 + 1)
    gen = torch.Generator().manual_seed(args.seed)
    log, step, started = [], 0, time.time()
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for b in range(0, n, args.batch_size):
            if step >= total:
                break
            lr = (
                args.lr * (step + 1) / warmup
                if step < warmup
                else args.lr
                * (
                    args.min_lr_ratio
                    + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
                )
            )
            for group in optim.param_groups:
                group["lr"] = lr
            optim.zero_grad()
            batch = order[b : b + args.batch_size]
            pairs = [len(data["seqs"][i]) - 2 for i in batch]  # pairs 0..len-3 of each sequence
            tokens = torch.zeros(len(batch), max(pairs), dtype=torch.long, device=device)
            hidden = torch.zeros(len(batch), max(pairs), feats[batch[0]].shape[-1], device=device)
            for row, (i, m) in enumerate(zip(batch, pairs)):
                tokens[row, :m] = torch.tensor(data["seqs"][i][1:-1])
                hidden[row, :m] = feats[i][:-1].to(device)
            outs = unrolled(head, tokens, hidden, args.ttt_steps)  # [B, n, H] per step, right-padded
            loss, agree = 0.0, []
            for row, (i, m) in enumerate(zip(batch, pairs)):
                first = data["starts"][i]  # pair p scores token p + 2: the teacher row of position p + 1, row p - first here
                probs, ids, weights = (data[key][i][1:].to(device) for key in ("probs", "ids", "weights"))
                one, a = head_loss(head, [out[row, :m] for out in outs], probs, ids, weights, first, to_draft)
                loss = loss + one / len(batch)
                agree.append(a)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            optim.step()
            step += 1
            if step % args.log_every == 0 or step == total:
                mean = [round(sum(a[s] for a in agree) / len(agree), 3) for s in range(args.ttt_steps)]
                print(
                    f"  step {step}/{total} lr {lr:.2e} loss {loss.item():.3f} top-1 agreement by step {mean} ({time.time() - started:.0f}s)",
                    flush=True,
                )
        if evaluate is not None:
            result = evaluate(head)
            log.append({"epoch": epoch + 1, "steps": step, "seconds": round(time.time() - started, 1), **result})
            print(f"[distill] epoch {epoch + 1}: held-out {json.dumps(result)}", flush=True)
    return {"steps": step, "train_time_s": round(time.time() - started, 1), "epochs": log}


@torch.inference_mode()
def held_out(head: FeatureHead, target, eval_data: dict, layers, steps: int) -> dict:
    """Agreement with the target's greedy continuations of the evaluation prompts, per drafting step (the
    first draft from the target's features, the later ones from the head's own outputs), overall and by category."""
    by_cat: dict[str, list[list[float]]] = {}
    for prompt, cont, cat in zip(eval_data["prompt_ids"], eval_data["greedy"], eval_data["categories"]):
        seq = torch.tensor(prompt + cont, device=head.d2t.device)
        feats = features(target, [seq.tolist()], layers)[0]
        outs = unrolled(head, seq[1:-1], feats[:-1], steps)
        first = len(prompt) - 2  # pair first scores the first continuation token... onwards
        hits = []
        for s, out in enumerate(outs, start=1):
            lo = max(first, s - 1)
            drafted = head.to_target_ids()[head.lm_head(head.norm(out[lo:])).argmax(-1)]
            hits.append((drafted == seq[lo + 2 :]).float().mean().item())
        by_cat.setdefault(cat, []).append(hits)
    mean = lambda rows, s: round(sum(r[s] for r in rows) / len(rows), 4)  # noqa: E731
    every = [r for rows in by_cat.values() for r in rows]
    return {
        "t0_agreement_by_step": [mean(every, s) for s in range(steps)],
        "t0_agreement_step1_by_category": {cat: mean(rows, 0) for cat, rows in by_cat.items()},
    }


def save_head(head: FeatureHead, out: Path, meta: dict) -> None:
    """The EAGLE-3 layout: config.json, model.safetensors (fp16 weights, d2t, t2d), and harness_head.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.half() if v.is_floating_point() else v).contiguous()
        for k, v in head.state_dict().items()
        if not k.startswith("rotary.")
    }
    save_file(state, out / "model.safetensors")
    config = head.config.to_dict() | {"torch_dtype": "float16", "architectures": ["LlamaForCausalLMEagle3"]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "harness_head.json").write_text(json.dumps(meta, indent=2) + "\n")


def reads(target) -> tuple[int, int, int]:
    return eagle3_layers(target.config.get_text_config(decoder=True).num_hidden_layers)
