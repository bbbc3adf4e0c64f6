"""Head training data in one pass: sample the target's continuations, and keep at every position the
teacher's top-k and the target's features, from the same forwards (harness.models.lean's ragged batch).

The two-pass data of harness.distill.data samples with `generate`, then runs a teacher forward over every
sequence, and harness.distill.head a third for the features. Here the prompt's prefill and every decode
step already compute both, so each position costs one forward of the target, at any batch size, on the
CPU or a GPU. A batch's rows leave it as they finish (their KV storage is dropped), so a long
continuation does not keep short ones' rows running.

Output, per sequence (prompt + continuation, cut after the first EOS): top-k probabilities [n, k] (fp16)
and ids [n, k] (int32) of the next-token distribution at temperature 1 at positions start .. len-2, and
features [len-1, F] (fp16) at positions 0 .. len-2: the same layout as the two-pass data.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from harness.base.files import cache_root, save_atomically
from harness.distill.data import data_key, job_payload, merge_jobs, position_weights, training_prompt_ids
from harness.models.lean import LeanLlama


@torch.inference_mode()
def sample_batch(
    lean: LeanLlama,
    prompts: list[list[int]],
    start: int,
    temperature: float,
    max_new: int,
    topk: int,
    layers: tuple[int, ...],
    eos: int,
    gen: torch.Generator,
) -> list[dict]:
    """One batch: prompts [B] of token ids, decoded together; per row its sequence, teacher top-k and features."""
    device = lean.model.lm_head.weight.device
    B, width = len(prompts), max(len(p) for p in prompts)
    lean.reserve(width + max_new)
    ids = torch.zeros(B, width, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(p)
    lengths = [len(p) for p in prompts]
    logits, feats = lean.forward(ids, [0] * B, [n - start for n in lengths], lengths, layers)  # [N, V], [B, W, F]
    out = [{"seq": list(p), "feats": [feats[row, : len(p)].half()], "probs": [], "ids": []} for row, p in enumerate(prompts)]
    per_row = [len(p) - start for p in prompts]
    rows_logits = list(logits.split(per_row))  # row r: [len - start, V], the last one predicts the first new token
    active = list(range(B))  # batch row i of the next pass is sequence active[i]
    step_logits = [rows_logits[r][-1] for r in active]
    for r in active:
        top = rows_logits[r].float().softmax(-1).topk(topk, dim=-1)
        out[r]["probs"].append(top.values.half().cpu())
        out[r]["ids"].append(top.indices.int().cpu())
    new = 0
    while active:
        step = torch.stack(step_logits).float()  # [A, V]
        if temperature > 0:
            drawn = torch.multinomial((step / temperature).softmax(-1), 1, generator=gen)[:, 0]
        else:
            drawn = step.argmax(-1)
        drawn_host = drawn.tolist()
        new += 1
        for r, token in zip(active, drawn_host):
            out[r]["seq"].append(token)
        going = [i for i, (r, token) in enumerate(zip(active, drawn_host)) if token != eos and new < max_new]
        if not going:
            break
        if len(going) < len(active):
            lean.keep_rows(going)
            active, drawn = [active[i] for i in going], drawn[going]
        starts = [len(out[r]["seq"]) - 1 for r in active]
        logits, feats = lean.forward(drawn[:, None], starts, [1] * len(active), capture=layers)  # [A, V], [A, 1, F]
        top = logits.float().softmax(-1).topk(topk, dim=-1)
        values, indices, feats = top.values.half().cpu(), top.indices.int().cpu(), feats[:, 0].half()
        for i, r in enumerate(active):
            out[r]["probs"].append(values[i : i + 1])
            out[r]["ids"].append(indices[i : i + 1])
            out[r]["feats"].append(feats[i : i + 1])
        step_logits = list(logits)
    return [
        {
            "seq": o["seq"],
            "probs": torch.cat(o["probs"])[: len(o["seq"]) - 1 - start],
            "ids": torch.cat(o["ids"])[: len(o["seq"]) - 1 - start],
            "feats": torch.cat(o["feats"]).cpu()[: len(o["seq"]) - 1],
        }
        for o in out
    ]


def sample_all(
    model,
    prompt_ids: list[list[int]],
    start: int,
    temperature: float,
    max_new: int,
    batch_size: int,
    seed: int,
    topk: int,
    layers: tuple[int, ...],
    eos: int,
    log_every: int = 1,
) -> list[dict]:
    """Every prompt's continuation (batches by prompt length; batch b sampled from a generator seeded seed + b,
    so the result depends on the prompts, the seed, the batch size and the device)."""
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    out: list[dict | None] = [None] * len(prompt_ids)
    device = model.lm_head.weight.device
    started, produced = time.time(), 0
    for b, first in enumerate(range(0, len(order), batch_size)):
        idx = order[first : first + batch_size]
        gen = torch.Generator(device=device).manual_seed(seed + b)
        lean = LeanLlama(model, rows=len(idx))
        for i, row in zip(
            idx, sample_batch(lean, [prompt_ids[i] for i in idx], start, temperature, max_new, topk, layers, eos, gen)
        ):
            out[i] = row
            produced += len(row["seq"]) - len(prompt_ids[i])
        if log_every and (b + 1) % log_every == 0:
            print(
                f"  sample T={temperature}: {first + len(idx)}/{len(order)} prompts, {produced} tokens, "
                f"{time.time() - started:.0f}s",
                flush=True,
            )
    return out  # type: ignore[return-value]


def one_pass_job(
    args,
    model,
    prompts,
    prompt_ids,
    common: int,
    prompt_seed: int,
    t_index: int,
    temperature: float,
    eos: int,
    layers,
    model_dir: Path,
) -> dict:
    """One continuation of every prompt at `temperature`, with the teacher's top-k and the features; cached on disk."""
    seed = prompt_seed * 1000 + t_index * 100_000
    payload = job_payload(args, prompts, temperature, seed, model_dir) | {
        "one_pass": True,
        "layers": list(layers),
        "device": str(model.lm_head.weight.device.type),
    }
    path = cache_root() / "distill" / f"onepass-{data_key(payload)}.pt"
    if path.exists() and not args.no_cache:
        print(f"[distill] prompt seed {prompt_seed}, T={temperature}: cached {path}", flush=True)
        return torch.load(path)
    started = time.time()
    start = common - 1
    rows = sample_all(
        model, prompt_ids, start, temperature, args.max_new_tokens, args.gen_batch_size, seed, args.topk, layers, eos
    )
    seqs = [r["seq"] for r in rows]
    job = {
        "payload": payload,
        "seqs": seqs,
        "prompt_lens": [len(p) for p in prompt_ids],
        "starts": [start] * len(seqs),
        "weights": [position_weights(len(p), start, len(s), args.prompt_weight) for p, s in zip(prompt_ids, seqs)],
        "categories": [c for c, _ in prompts],
        "probs": [r["probs"] for r in rows],
        "ids": [r["ids"] for r in rows],
        "feats": [r["feats"] for r in rows],
        "gen_time_s": time.time() - started,
        "teacher_time_s": 0.0,
    }
    save_atomically(job, path)
    return job


def build_one_pass_data(args, model, tok, model_dir: Path, layers: tuple[int, ...]) -> dict:
    """One continuation of every training prompt of every --prompt-seeds at every --temperatures (at T=0, of
    the prompts no earlier seed made), sampled on the model's device, with the teacher's top-k and the features at `layers`: harness.distill.data's layout plus "feats"."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    jobs, num_prompts, greedy_done = [], 0, set()
    for prompt_seed in args.prompt_seeds or [args.seed]:
        prompts, prompt_ids, common = training_prompt_ids(args, tok, prompt_seed)
        num_prompts += len(prompts)
        for t_index, temperature in enumerate(args.temperatures):
            keep = range(len(prompts))
            if temperature == 0:  # a prompt another seed also made has the same greedy continuation: once is enough
                keep = [i for i in keep if prompts[i][1] not in greedy_done]
                greedy_done.update(prompts[i][1] for i in keep)
            chosen, chosen_ids = [prompts[i] for i in keep], [prompt_ids[i] for i in keep]
            jobs.append(
                one_pass_job(args, model, chosen, chosen_ids, common, prompt_seed, t_index, temperature, eos, layers, model_dir)
            )
    return merge_jobs(jobs, model.config.vocab_size, num_prompts, keys=("feats",))
