"""The draft's head subset, its training against the teacher's top-k, and its held-out evaluation."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]


def choose_head(tok, mass: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` tokens with the most mass, plus the special and newline tokens (sorted ids)."""
    required = {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    required |= {i for i in range(len(tok)) if "\n" in (s := tok.decode([i])) and not s.strip()}
    required = {i for i in required if i < mass.shape[0]}
    assert len(required) < size, f"head of {size} tokens cannot hold the {len(required)} required ones"
    chosen = list(required)
    for i in mass.argsort(descending=True).tolist():
        if len(chosen) == size:
            break
        if i not in required:
            chosen.append(i)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def draft_subset_logits(draft, input_ids: torch.Tensor) -> torch.Tensor:
    """Draft logits over its head subset only: [B, T, S]."""
    hidden = draft.model(input_ids=input_ids, use_cache=False).last_hidden_state
    return hidden @ draft.lm_head.weight.T


def train(args, draft, data: dict, head_ids: torch.Tensor) -> dict:
    vocab = draft.config.vocab_size
    to_subset = torch.full((vocab,), -1, dtype=torch.long)
    to_subset[head_ids] = torch.arange(head_ids.numel())
    for p in draft.parameters():
        p.requires_grad_(False)
    params = [p for m in (draft.model.layers, draft.model.norm) for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    assert not draft.lm_head.weight.requires_grad and not draft.model.embed_tokens.weight.requires_grad
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    seqs = data["seqs"]
    steps_per_epoch = math.ceil(len(seqs) / args.batch_size)
    total = steps_per_epoch * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    warmup = min(args.warmup, total // 10 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    draft.train()
    step, started, history = 0, time.time(), []
    for epoch in range(args.epochs):
        if step == total:
            break
        order = torch.randperm(len(seqs), generator=gen).tolist()
        run_loss = run_w = run_agree = 0.0
        for first in range(0, len(order), args.batch_size):
            if step == total:
                break
            idx = order[first : first + args.batch_size]
            width = max(len(seqs[i]) for i in idx)
            B, k = len(idx), args.topk
            ids = torch.zeros((B, width), dtype=torch.long)
            tprob = torch.zeros((B, width, k))
            tsub = torch.zeros((B, width, k), dtype=torch.long)
            tsub_valid = torch.zeros((B, width, k), dtype=torch.bool)
            w = torch.zeros((B, width))
            for row, i in enumerate(idx):
                n, st = len(seqs[i]), data["starts"][i]
                ids[row, :n] = torch.tensor(seqs[i])
                sub = to_subset[data["ids"][i].long()]
                tprob[row, st : n - 1] = data["probs"][i].float()
                tsub[row, st : n - 1] = sub.clamp_min(0)
                tsub_valid[row, st : n - 1] = sub >= 0
                w[row, st : n - 1] = data["weights"][i]
            logq = F.log_softmax(draft_subset_logits(draft, ids), dim=-1)  # [B, T, S]
            picked = logq.gather(-1, tsub)  # [B, T, k]
            soft = -(tprob * tsub_valid * picked).sum(-1)
            top1 = -(picked[..., 0] * tsub_valid[..., 0])
            loss = (w * (soft + args.top1_weight * top1)).sum() / w.sum()
            for group in optim.param_groups:
                group["lr"] = lr_at(step)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            optim.step()
            step += 1
            with torch.no_grad():
                agree = ((logq.argmax(-1) == tsub[..., 0]) & tsub_valid[..., 0]).float()
                cont = w == 1.0
                run_agree += (agree * cont).sum().item()
                run_w += cont.sum().item()
                run_loss += loss.item()
            if step % args.log_every == 0 or first + args.batch_size >= len(order) or step == total:
                print(
                    f"  epoch {epoch + 1}/{args.epochs} step {step}/{total} lr {lr_at(step - 1):.2e} "
                    f"loss {loss.item():.3f} train top-1 agree (cont.) {run_agree / max(run_w, 1):.3f} "
                    f"{time.time() - started:.0f}s",
                    flush=True,
                )
        history.append(
            {
                "epoch": epoch + 1,
                "mean_loss": run_loss / max(1, step - epoch * steps_per_epoch),
                "train_top1_agreement": run_agree / max(run_w, 1),
            }
        )
    draft.eval()
    for p in params:
        p.requires_grad_(False)
    return {"steps": step, "train_time_s": time.time() - started, "history": history}


@torch.inference_mode()
def evaluate(target, draft, eval_data: dict) -> dict:
    """T=0 agreement on greedy continuations and mean sum min(p, q) at T=1 on sampled ones."""
    head_ids = draft.lm_head.token_ids
    result = {}
    for name in ("greedy", "sampled"):
        per_cat: dict[str, list[float]] = {}
        for cat, prompt, cont in zip(eval_data["categories"], eval_data["prompt_ids"], eval_data[name]):
            if not cont:
                continue
            ids = torch.tensor([prompt + cont])
            lo, hi = len(prompt) - 1, len(prompt) + len(cont) - 1  # positions predicting the continuation
            p_logits = target(input_ids=ids, use_cache=False).logits[0, lo:hi].float()
            q_logits = draft_subset_logits(draft, ids)[0, lo:hi].float()
            if name == "greedy":
                values = (head_ids[q_logits.argmax(-1)] == p_logits.argmax(-1)).float()
            else:
                p = p_logits.softmax(-1)[:, head_ids]
                values = torch.minimum(p, q_logits.softmax(-1)).sum(-1)
            sums = per_cat.setdefault(cat, [0.0, 0])
            sums[0] += values.sum().item()
            sums[1] += values.numel()
        key = "t0_agreement" if name == "greedy" else "t1_sum_min_pq"
        result[key] = sum(s for s, _ in per_cat.values()) / sum(n for _, n in per_cat.values())
        result[key + "_by_category"] = {c: s / n for c, (s, n) in sorted(per_cat.items())}
        result[name + "_positions"] = sum(n for _, n in per_cat.values())
    return result


def default_init_layers(num_layers: int, target_layers: int) -> list[int]:
    first = (num_layers + 1) // 2
    return list(range(first)) + list(range(target_layers - (num_layers - first), target_layers))
