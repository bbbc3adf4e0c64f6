"""The distillation data: training prompts made from templates and topic lists (prompts.json),
the target's continuations of them, and the teacher's top-k distributions, cached on disk."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from pathlib import Path

import torch
import transformers

from harness.base.files import cache_root, json_digest, save_atomically
from harness.data.prompts import load_builtin

PROMPT_LISTS = Path(__file__).with_name("prompts.json")
DATA_FORMAT = 1  # bump when the cached data layout or its generation changes


def load_prompt_lists() -> dict:
    """The topic lists and templates the training prompts are made of (prompts.json beside this module)."""
    return json.loads(PROMPT_LISTS.read_text())


def training_prompts(seed: int) -> list[tuple[str, str]]:
    """(category, prompt) pairs, deterministic in `seed`."""
    lists = load_prompt_lists()
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    chat = lists["conversation"]
    for goal in chat["advice_goals"]:
        out.append(("conversation", rng.choice(chat["advice_templates"]).format(goal=goal)))
    for idea in chat["story_ideas"]:
        out.append(("conversation", chat["story_template"].format(words=rng.choice(chat["story_words"]), idea=idea)))
    for case in chat["message_cases"]:
        out.append(("conversation", chat["message_template"].format(**case)))
    for subject in chat["poem_subjects"]:
        out.append(("conversation", chat["poem_template"].format(subject=subject)))
    for request in chat["idea_requests"]:
        out.append(("conversation", chat["idea_template"].format(**request)))
    translation = lists["translation"]
    for sentence in translation["en_sentences"]:
        for lang in rng.sample(translation["target_languages"], 3):
            out.append(("translation", rng.choice(translation["translate_to_templates"]).format(lang=lang, text=sentence)))
    for foreign in translation["foreign_sentences"]:
        for template in rng.sample(translation["translate_from_templates"], 2):
            out.append(("translation", template.format(**foreign)))
    summaries = lists["summarization"]
    for passage in summaries["passages"]:
        for form in rng.sample(summaries["forms"], 3):
            out.append(("summarization", summaries["template"].format(form=form, **passage)))
    for question in lists["qa"]["questions"]:
        out.append(("qa", question + rng.choice(lists["qa"]["suffixes"])))
    people = [(p["name"], p["pronoun"]) for p in lists["math"]["people"]]
    out.extend(("math", p) for p in math_problems(rng, people, lists["math"]["suffixes"]))
    code = lists["code"]
    for task in code["tasks"]:
        for template in rng.sample(code["task_templates"], 2):
            out.append(("code", template.format(task=task)))
    out.extend(("code", t) for t in code["other_language_tasks"])
    for snippet in code["snippets"]:
        out.append(("code", rng.choice(code["snippet_templates"]).format(code=snippet)))
    return out


def math_problems(rng: random.Random, people: list[tuple[str, str]], suffixes: list[str]) -> list[str]:
    """Word problems with random numbers, about `people` ((name, pronoun) pairs), each ending in one of
    `suffixes`. Each kind of problem keeps its wording beside the arithmetic that makes it consistent."""
    problems = []

    def n(lo: int, hi: int) -> int:
        return rng.randint(lo, hi)

    for _ in range(6):
        a, b, c, d = n(2, 9), n(2, 6), n(3, 12), n(2, 5)
        name, pron = rng.choice(people)
        problems.append(
            f"{name} buys {a} notebooks that cost ${b} each and {c} pencils that cost "
            f"${d / 4:.2f} each. How much does {pron} pay in total?"
        )
    for _ in range(6):
        speed, hours = n(40, 95), n(2, 6)
        problems.append(
            f"A car travels at {speed} kilometres per hour for {hours} hours. How far does it go, "
            f"and how long would the same trip take at {speed + 10} kilometres per hour?"
        )
    for _ in range(6):
        total, frac_num, frac_den = n(3, 9) * 12, n(1, 3), 4
        problems.append(
            f"A box holds {total} apples. {frac_num}/{frac_den} of them are green and the rest are "
            f"red. How many red apples are in the box?"
        )
    for _ in range(6):
        length, width = n(5, 30), n(3, 20)
        problems.append(
            f"A room is {length} metres long and {width} metres wide. What is its area, and how "
            f"many square tiles of 1 square metre are needed to cover the floor?"
        )
    for _ in range(6):
        price, pct = n(20, 200), rng.choice([10, 15, 20, 30, 40, 50])
        problems.append(f"A jacket costs ${price}. During a sale the price is reduced by {pct}%. What is the new price?")
    for _ in range(6):
        start_h, start_m, dur_h, dur_m = n(6, 15), rng.choice([0, 10, 20, 30, 45]), n(1, 4), rng.choice([15, 25, 40, 55])
        problems.append(
            f"A movie starts at {start_h}:{start_m:02d} and lasts {dur_h} hours and {dur_m} minutes. At what time does it end?"
        )
    for _ in range(6):
        per_day, total = n(4, 25), n(3, 15)
        name, pron = rng.choice(people)
        problems.append(
            f"{name} runs {per_day} kilometres every day. How many kilometres does "
            f"{pron} run in {total} days, and in how many days would "
            f"{pron} reach {per_day * total + per_day * 5} kilometres?"
        )
    for _ in range(6):
        group, cost, extra = n(3, 8), n(20, 90), n(2, 6)
        problems.append(
            f"{group} friends rent a boat for ${cost} and buy snacks for ${extra}.50 in total. If "
            f"they share the cost equally, how much does each person pay?"
        )
    for _ in range(6):
        heads = n(10, 30)
        cats = n(1, heads - 1)
        legs = cats * 4 + (heads - cats) * 2
        problems.append(
            f"In a yard there are ducks and cats. Together they have {heads} heads and {legs} legs. "
            f"How many ducks and how many cats are there?"
        )
    for _ in range(6):
        have, goal, weekly = n(10, 60), n(100, 400), n(5, 25)
        name, pron = rng.choice(people)
        problems.append(
            f"{name} has ${have} and wants to buy a tablet that costs ${goal}. "
            f"{pron.capitalize()} saves ${weekly} each week. How many weeks will it take?"
        )
    for _ in range(6):
        a, b = n(12, 99), n(3, 9)
        problems.append(f"What is {a} multiplied by {b}, and what is the remainder when {a * b + n(1, b - 1)} is divided by {b}?")
    return [f"{p} {rng.choice(suffixes)}" for p in problems]


def load_eval_prompts() -> list[dict]:
    """The evaluation prompts: the builtin set, never trained on."""
    return load_builtin()


def drop_overlapping(train: list[tuple[str, str]], evaluation: list[dict], ngram: int = 10) -> list[tuple[str, str]]:
    """The training prompts sharing no run of `ngram` words with an evaluation prompt (the others are left out, and
    said so: a template's fixed words can meet an evaluation prompt's)."""

    def shingles(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)}

    eval_shingles = set().union(*(shingles(e["prompt"]) for e in evaluation))
    kept = [(category, prompt) for category, prompt in train if not shingles(prompt) & eval_shingles]
    if len(kept) < len(train):
        print(
            f"[distill] {len(train) - len(kept)} training prompts share {ngram} words in a row with an evaluation prompt: left out"
        )
    return kept


def encode_prompts(tok, prompts: list[str]) -> list[list[int]]:
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts
    ]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


@torch.inference_mode()
def generate(
    model,
    prompt_ids: list[list[int]],
    temperature: float,
    max_new: int,
    batch_size: int,
    seed: int,
    eos: int,
    log_every: int = 1,
    partial_dir: Path | None = None,
) -> list[list[int]]:
    """Continuations (each cut after the first EOS, which is kept) of every prompt.

    Prompts are batched by length (left padding, attention mask); the batch b
    is sampled after torch.manual_seed(seed + b), so the result depends only
    on the prompts, the seed and the batch size. With `partial_dir`, every
    batch is saved there as it is done, and an interrupted run resumes.
    """
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    out: list[list[int] | None] = [None] * len(prompt_ids)
    started, produced = time.time(), 0
    for b, first in enumerate(range(0, len(order), batch_size)):
        idx = order[first : first + batch_size]
        part = partial_dir / f"T{temperature}-seed{seed}-b{b}.pt" if partial_dir else None
        if part is not None and part.exists():
            for i, cont in zip(idx, torch.load(part)):
                out[i] = cont
                produced += len(cont)
            continue
        width = max(len(prompt_ids[i]) for i in idx)
        ids = torch.full((len(idx), width), eos, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompt_ids[i]) :] = torch.tensor(prompt_ids[i])
            mask[row, width - len(prompt_ids[i]) :] = 1
        torch.manual_seed(seed + b)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=eos, eos_token_id=eos, **sampling
        )
        for row, i in enumerate(idx):
            cont = gen[row, width:].tolist()
            if eos in cont:
                cont = cont[: cont.index(eos) + 1]
            out[i] = cont
            produced += len(cont)
        if part is not None:
            part.parent.mkdir(parents=True, exist_ok=True)
            torch.save([out[i] for i in idx], part.with_suffix(".tmp"))
            part.with_suffix(".tmp").rename(part)
        if log_every and (b + 1) % log_every == 0:
            print(
                f"  generate T={temperature}: {first + len(idx)}/{len(order)} prompts, {produced} tokens, "
                f"{time.time() - started:.0f}s",
                flush=True,
            )
    return out  # type: ignore[return-value]


def batches_by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@torch.inference_mode()
def teacher_topk(model, seqs: list[list[int]], starts: list[int], k: int, batch_size: int, pad: int):
    """Per sequence: top-k probabilities [n, k] (fp16) and ids [n, k] (int32) of the target's
    next-token distribution (temperature 1) at positions starts[i] .. len-2."""
    probs_out: list[torch.Tensor | None] = [None] * len(seqs)
    ids_out: list[torch.Tensor | None] = [None] * len(seqs)
    started = time.time()
    for bi, idx in enumerate(batches_by_length([len(s) for s in seqs], batch_size)):
        width = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        logits = model(input_ids=ids, use_cache=False).logits  # right padding: causal, no mask needed
        for row, i in enumerate(idx):
            top = logits[row, starts[i] : len(seqs[i]) - 1].float().softmax(-1).topk(k, dim=-1)
            probs_out[i] = top.values.half()
            ids_out[i] = top.indices.int()
        if (bi + 1) % 20 == 0:
            print(f"  teacher: batch {bi + 1}, {time.time() - started:.0f}s", flush=True)
    return probs_out, ids_out


def position_weights(prompt_len: int, start: int, seq_len: int, prompt_weight: float) -> torch.Tensor:
    """Weights of positions start .. seq_len-2: a position predicting a prompt token gets prompt_weight."""
    pos = torch.arange(start, seq_len - 1)
    return torch.where(pos + 1 < prompt_len, prompt_weight, 1.0).float()


def data_key(payload: dict) -> str:
    return json_digest(payload, 16)


def job_payload(args, prompts: list[tuple[str, str]], temperature: float, seed: int, model_dir: Path) -> dict:
    """What a cached training job depends on, common to both kinds of data (each adds its own keys)."""
    return {
        "format": DATA_FORMAT,
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "temperature": temperature,
        "seed": seed,
        "max_new_tokens": args.max_new_tokens,
        "gen_batch_size": args.gen_batch_size,
        "topk": args.topk,
        "prompt_weight": args.prompt_weight,
        "model": str(model_dir),
        "torch": str(torch.__version__),
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }


def training_job(
    args,
    model,
    prompts: list[tuple[str, str]],
    prompt_ids: list[list[int]],
    common: int,
    t_index: int,
    temperature: float,
    eos: int,
    model_dir: Path,
) -> dict:
    """One continuation of every prompt at `temperature`, with the teacher's top-k; cached on disk."""
    seed = args.seed * 1000 + t_index * 100_000
    payload = job_payload(args, prompts, temperature, seed, model_dir) | {"teacher_batch_size": args.teacher_batch_size}
    path = cache_root() / "distill" / f"train-{data_key(payload)}.pt"
    if path.exists() and not args.no_cache:
        print(f"[distill] T={temperature}: cached {path}", flush=True)
        return torch.load(path)
    started = time.time()
    conts = generate(
        model,
        prompt_ids,
        temperature,
        args.max_new_tokens,
        args.gen_batch_size,
        seed,
        eos,
        log_every=1,
        partial_dir=path.with_suffix(".partial"),
    )
    gen_time = time.time() - started
    seqs = [p + c for p, c in zip(prompt_ids, conts)]
    prompt_lens = [len(p) for p in prompt_ids]
    starts = [common - 1] * len(seqs)
    weights = [position_weights(pl, st, len(s), args.prompt_weight) for pl, st, s in zip(prompt_lens, starts, seqs)]
    started = time.time()
    probs, ids = teacher_topk(model, seqs, starts, args.topk, args.teacher_batch_size, eos)
    job = {
        "payload": payload,
        "seqs": seqs,
        "prompt_lens": prompt_lens,
        "starts": starts,
        "weights": weights,
        "categories": [c for c, _ in prompts],
        "probs": probs,
        "ids": ids,
        "gen_time_s": gen_time,
        "teacher_time_s": time.time() - started,
    }
    save_atomically(job, path)
    shutil.rmtree(path.with_suffix(".partial"), ignore_errors=True)
    return job


def training_prompt_ids(args, tok, seed: int) -> tuple[list[tuple[str, str]], list[list[int]], int]:
    """The training prompts made with `seed` (checked disjoint from the evaluation set, cut to --max-prompts),
    their chat-formatted ids, and the length of the preamble they all share (losses start where they differ)."""
    prompts = drop_overlapping(training_prompts(seed), load_eval_prompts())
    if args.max_prompts:
        prompts = prompts[:: max(1, len(prompts) // args.max_prompts)][: args.max_prompts]
    prompt_ids = encode_prompts(tok, [p for _, p in prompts])
    common = 0
    while all(len(p) > common + 1 for p in prompt_ids) and len({p[common] for p in prompt_ids}) == 1:
        common += 1
    return prompts, prompt_ids, common


def merge_jobs(jobs: list[dict], vocab_size: int, num_prompts: int, keys: tuple[str, ...] = ()) -> dict:
    """The jobs' sequences as one data set, with the target's probability mass per token over the training
    positions (from the top-k, loss-weighted) for choosing the draft vocabulary."""
    data = {
        key: [x for job in jobs for x in job[key]]
        for key in ("seqs", "prompt_lens", "starts", "weights", "categories", "probs", "ids", *keys)
    }
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for p, i, w in zip(data["probs"], data["ids"], data["weights"]):
        mass.index_add_(0, i.flatten().long(), (p.double() * w.double()[:, None]).flatten())
    data.update(
        mass=mass,
        num_prompts=num_prompts,
        generated_tokens=sum(len(s) - pl for s, pl in zip(data["seqs"], data["prompt_lens"])),
        gen_time_s=sum(job["gen_time_s"] for job in jobs),
        teacher_time_s=sum(job["teacher_time_s"] for job in jobs),
    )
    return data


def build_training_data(args, model, tok, model_dir: Path) -> dict:
    """All training sequences (one per prompt and temperature), teacher top-k and token masses."""
    prompts, prompt_ids, common = training_prompt_ids(args, tok, args.seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    jobs = [
        training_job(args, model, prompts, prompt_ids, common, t_index, temperature, eos, model_dir)
        for t_index, temperature in enumerate(args.temperatures)
    ]
    return merge_jobs(jobs, model.config.vocab_size, len(prompts))


def build_eval_data(args, model, tok, model_dir: Path) -> dict:
    prompts = load_eval_prompts()
    if args.eval_prompts:
        prompts = prompts[:: max(1, len(prompts) // args.eval_prompts)][: args.eval_prompts]
    payload = {
        "format": DATA_FORMAT,
        "ids": [p["id"] for p in prompts],
        "seed": args.eval_seed,
        "new_tokens": args.eval_new_tokens,
        "batch": args.gen_batch_size,
        "model": str(model_dir),
        "torch": str(torch.__version__),
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    path = cache_root() / "distill" / f"eval-{data_key(payload)}.pt"
    if path.exists() and not args.no_cache:
        return torch.load(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = encode_prompts(tok, [p["prompt"] for p in prompts])
    data = {"categories": [p["category"] for p in prompts], "prompt_ids": prompt_ids}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        data[name] = generate(
            model, prompt_ids, temperature, args.eval_new_tokens, args.gen_batch_size, args.eval_seed, eos, log_every=0
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # an interrupted save is never loaded as the data
    return data
