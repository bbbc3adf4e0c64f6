"""The bench's measuring parts: throughput against HF, the limit (measured against predicted
speedup), where decode time goes outside forward passes, memory across prompts, and our batched baseline
against HF's (host reads and the one-prompt profile: harness.bench.audit)."""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf
from scipy import stats

from harness.bench.contenders import GREEDY, ForwardCounter, fewest_lookup_passes
from harness.bench.contenders import contenders as build_contenders
from harness.bench.timing import Stopwatch, TimedLM, timed_call, timed_drafter
from harness.core import loop, metrics
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.metrics import ratio
from harness.core.sampling import Sampling
from harness.core.ties import same_greedy_output
from harness.runner.cell import run_prompt
from harness.runner.costs import measure_costs, sync
from harness.runner.provenance import current_rss_mb, peak_rss_mb, reset_peak_rss

SPREAD_NOTE = (
    "cv: the coefficient of variation of a speedup over the repetitions (sample standard deviation / mean, "
    "scipy.stats.variation with ddof=1); a difference between two drafts smaller than about twice it is noise on this machine"
)


def median_and_cv(per_rep: Sequence[float]) -> tuple[float, float]:
    """A figure's median over repetitions and their coefficient of variation (scipy.stats.variation,
    ddof=1: sample standard deviation / mean); the cv is nan with fewer than two repetitions."""
    values = [float(v) for v in per_rep]
    if not values:
        return float("nan"), float("nan")
    return statistics.median(values), float(stats.variation(values, ddof=1)) if len(values) > 1 else float("nan")


@dataclass
class Tally:
    """What the throughput part has counted so far."""

    tokens_per_s: dict[str, list[float]]  # contender -> [reps] its total tokens / total time in each repetition
    forwards: dict[str, int] = field(default_factory=dict)  # contender -> target passes in a repetition
    tokens_per_rep: dict[str, int] = field(default_factory=dict)  # contender -> tokens in a repetition
    fewest: dict[int, int] = field(default_factory=dict)  # k -> target passes of a lookup that knew the output
    same_as_hf: dict[str, int] = field(default_factory=dict)  # comparison -> prompt runs with the very same tokens
    ties: list[dict] = field(default_factory=list)  # greedy outputs parted at a numerical tie


def throughput_figures(tally: Tally, pairs: dict[str, tuple[str, str]], reps_done: int, prompts: int) -> dict:
    """The throughput figures over the repetitions so far; `pairs` names each comparison (ours, HF's)."""
    tokens_per_s, forwards, tokens_per_rep, fewest = tally.tokens_per_s, tally.forwards, tally.tokens_per_rep, tally.fewest
    median = {name: statistics.median(v) for name, v in tokens_per_s.items()}
    # Contenders alternate within a repetition, so each repetition gives a paired ratio, and a ratio is
    # their median: a drift of the machine's speed between repetitions cancels within each pair. The
    # ratio of the contenders' medians does not: with such a drift both medians fall in one repetition
    # and give that one repetition's ratio.
    per_rep = {name: [a / b for a, b in zip(tokens_per_s[ours], tokens_per_s[theirs])] for name, (ours, theirs) in pairs.items()}
    spread = {name: median_and_cv(v) for name, v in per_rep.items()}
    ratios = {name: m for name, (m, _) in spread.items()}
    # ours/HF tokens per second = (HF's target passes per token / ours) x (HF's time per pass / ours):
    # how much of a lead comes from verifying more tokens per pass, how much from a cheaper pass.
    fewer_passes = {
        name: (forwards[theirs] / tokens_per_rep[theirs]) / (forwards[ours] / tokens_per_rep[ours])
        for name, (ours, theirs) in pairs.items()
    }
    return {
        "reps_done": reps_done,
        "tokens_per_s": median,
        "tokens_per_s_all_reps": tokens_per_s,
        "target_forwards_per_rep": forwards,
        "tokens_per_rep": tokens_per_rep,
        "ratios": ratios,
        "ratio_cv": {name: cv for name, (_, cv) in spread.items()},  # over the per-rep ratios: SPREAD_NOTE
        "ratio_of_medians": {name: median[ours] / median[theirs] for name, (ours, theirs) in pairs.items()},
        "ratio_parts": {
            name: {"fewer_target_passes": part, "cheaper_time_per_pass": ratios[name] / part}
            for name, part in fewer_passes.items()
        },
        "ratio_per_rep": per_rep,
        "greedy_ties": tally.ties,
        # How far any prompt lookup could go here: HF's target passes over the fewest possible.
        "lookup_floor": {
            k: {
                "hf_passes": forwards[f"hf_lookup_k{k}"],
                "ours_passes": forwards[f"ours_ngram_k{k}"],
                "fewest_passes": fewest[k],
                "most_fewer_passes_than_hf": forwards[f"hf_lookup_k{k}"] / fewest[k],
            }
            for k in fewest
        },
        "same_output_as_hf": {name: count / (reps_done * prompts) for name, count in tally.same_as_hf.items()},
    }


def throughput(pair, encoded, args, device, on_rep=None) -> dict:
    """Part 1: every contender on every prompt, interleaved prompt by prompt (order alternating), over
    args.reps repetitions; `on_rep` gets the figures so far after each repetition but the last."""
    target = pair.target
    verify_cost = measure_costs(pair, encoded[0], max(args.ks), GREEDY)["verify_cost"]
    contenders, rivals = build_contenders(pair, args.ks, args.max_new_tokens, verify_cost)

    # Warm-up, excluded. Compiled, every contender decodes every prompt once: our steps are compiled ahead
    # (Pair.warm_up) but HF's compile each new step shape when it first meets it, inside a timed rep otherwise.
    for ids in encoded if target.compiled is not None else [ids[-16:] for ids in encoded[:2]]:
        for fn in contenders.values():
            fn(ids)

    pairs = {f"{ours} / {theirs}": (ours, theirs) for ours, theirs in rivals.items()}  # how results name each comparison
    counter = ForwardCounter(target.model)
    tally = Tally(
        tokens_per_s={name: [] for name in contenders},
        fewest={k: 0 for k in args.ks},
        same_as_hf={name: 0 for name in pairs},
    )
    for rep in range(args.reps):
        totals = {name: [0, 0.0, 0] for name in contenders}
        for i, ids in enumerate(encoded):
            names = list(contenders) if (rep + i) % 2 == 0 else list(reversed(contenders))
            outputs = {}
            for name in names:
                before = counter.count
                tokens, seconds = timed_call(lambda name=name, ids=ids: contenders[name](ids), device)
                outputs[name] = tokens
                totals[name][0] += len(tokens)
                totals[name][1] += seconds
                totals[name][2] += counter.count - before
            for name, tokens in outputs.items():
                tie = same_greedy_output(target, ids, outputs["ours_base"], tokens, name, i)
                if tie is not None:
                    tally.ties.append({**tie, "rep": rep})
            for name, (ours, theirs) in pairs.items():
                tally.same_as_hf[name] += outputs[ours] == outputs[theirs]
            if rep == 0:
                for k in args.ks:
                    tally.fewest[k] += fewest_lookup_passes(ids.tolist(), outputs["ours_base"], k)
        for name, (tokens, seconds, passes) in totals.items():
            tally.tokens_per_s[name].append(tokens / seconds)
            tally.forwards[name], tally.tokens_per_rep[name] = passes, tokens
        print(
            f"[bench] rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tally.tokens_per_s.items()),
            file=sys.stderr,
        )
        if on_rep is not None and rep + 1 < args.reps:  # a run cut off later (the GPU check's timeouts) keeps these
            on_rep(throughput_figures(tally, pairs, rep + 1, len(encoded)))
    return throughput_figures(tally, pairs, args.reps, len(encoded))


def decode_phase(generator, device, lms: list[TimedLM], watch: Stopwatch) -> dict:
    """Run a decode generator; time and forward/rule/rollback time after its first
    yield (prefill and first cycle apart), and every item it yields."""

    def spent():
        return {
            "forward": sum(lm.forward_s for lm in lms),
            "rollback": sum(lm.rollback_s for lm in lms),
            **watch.seconds,
            **{f"forward_{i}": lm.forward_s for i, lm in enumerate(lms)},
            **{f"forwards_{i}": lm.forwards for i, lm in enumerate(lms)},
            **{f"forward_{i}@{n}": t for i, lm in enumerate(lms) for n, (t, _) in lm.by_positions.items()},
            **{f"forwards_{i}@{n}": m for i, lm in enumerate(lms) for n, (_, m) in lm.by_positions.items()},
        }

    items, first_at, first_spent = [], None, None
    sync(device)
    start = time.perf_counter()
    for item in generator:
        items.append(item)
        if first_at is None:
            sync(device)
            first_at, first_spent = time.perf_counter(), spent()
    sync(device)
    end = time.perf_counter()
    after = spent()
    return {
        "items": items,
        "total_s": end - start,
        "decode_s": end - first_at,
        "decode_spent": {key: after.get(key, 0.0) - first_spent.get(key, 0.0) for key in after},
    }


def limit(pair, encoded, k: int, n: int, device, reps: int = 1) -> dict:
    """Decode-phase speedup against the speedup the measured costs and acceptance allow.

    The decode phase starts after the first yield: the baseline's prompt pass
    gives its first token, and speculative decoding's first cycle is the
    prompt's pass plus k drafts; both are left out, with the tokens they yield.
    The measured speedup is the median over `reps` passes over the prompts (one
    pass of 6 prompts x 32 tokens moved by +-3% on this project's 2-core machine),
    with its coefficient of variation over them (SPREAD_NOTE). The predictions and
    efficiencies have a run summary's names and meanings (`predictions`).
    """
    costs = measure_costs(pair, encoded[0], k, GREEDY)
    c, v = costs["cost_ratio"], costs["verify_cost"]  # v[j] = v(j + 1)
    spec_target, base_target = TimedLM(pair.target), TimedLM(pair.target)
    draft, drafter = timed_drafter(pair.drafter)  # a draft forward is a head's step or a draft model's pass
    watch = Stopwatch(device)
    saved = loop.greedy_rows, loop.apply_stops
    loop.greedy_rows, loop.apply_stops = watch.wrap("rule", loop.greedy_rows), watch.wrap("stops", loop.apply_stops)
    decode_cycles, all_cycles, spent = [], [], defaultdict(float)
    runs = []  # each speculative run's counts (metrics.cycle_counts), as a run's records hold them
    per_rep = []  # [reps] (spec tokens, spec s, base tokens, base s) of the decode phase
    try:
        for rep in range(reps):
            totals = [0, 0.0, 0, 0.0]
            for i, ids in enumerate(encoded):
                order = ("spec", "base") if (rep + i) % 2 == 0 else ("base", "spec")
                for which in order:
                    if which == "spec":
                        run = decode_phase(
                            speculative_decode(spec_target, drafter, ids, k, GREEDY, n, pair.eos_ids, None),
                            device,
                            [spec_target, draft],
                            watch,
                        )
                        decode_cycles += run["items"][1:]
                        all_cycles += run["items"]
                        runs.append({"spec": metrics.cycle_counts(run["items"], k)})
                        totals[0] += sum(len(cy.tokens) for cy in run["items"][1:])
                        totals[1] += run["decode_s"]
                        for key, value in run["decode_spent"].items():
                            spent[key] += value
                    else:
                        run = decode_phase(
                            autoregressive_decode(base_target, ids, GREEDY, n, pair.eos_ids, None),
                            device,
                            [base_target],
                            Stopwatch(device),
                        )
                        totals[2] += len(run["items"]) - 1
                        totals[3] += run["decode_s"]
                        spent["base_forward"] += run["decode_spent"]["forward_0"]
                        spent["base_forwards"] += run["decode_spent"]["forwards_0"]
            per_rep.append(totals)
    finally:
        loop.greedy_rows, loop.apply_stops = saved
    spec_tokens, spec_s, base_tokens, base_s = (sum(column) for column in zip(*per_rep))
    speedups = [ratio(ratio(st, ss), ratio(bt, bs)) for st, ss, bt, bs in per_rep]
    instrumented = {}
    if device.type == "cuda":
        # The breakdown above synchronises after every forward, which on a GPU serialises the
        # draft's queued forwards: the measured speedup comes from the same passes uninstrumented.
        instrumented = {"measured_speedup_instrumented": statistics.median(speedups)}
        speedups = [plain_decode_speedup(pair, encoded, k, n, device, rep) for rep in range(reps)]
    measured, measured_cv = median_and_cv(speedups)
    counts = metrics.cycle_counts(all_cycles, k)
    alpha = ratio(counts["accepted"], counts["tested"])
    # The same prediction from what the forwards cost inside the loop: on a CPU the two
    # models evict each other's weights from the caches, so a step costs more in the
    # loop than in measure_costs' isolated repetitions.
    step_in_loop = ratio(spent["base_forward"], spent["base_forwards"])
    drafted = sum(cy.num_drafted for cy in decode_cycles)
    c_loop = ratio(ratio(spent["forward_1"], spent["forwards_1"]), step_in_loop)  # nan: nothing drafted (every run ended early)
    # v(n) in the loop, from its verify passes over n positions (every decode-phase target forward
    # is one; cycles near the token budget verify fewer than k + 1, and are kept apart).
    v_loop_n = {
        n: spent[f"forward_0@{n}"] / spent[f"forwards_0@{n}"] / step_in_loop
        for n in range(1, k + 2)
        if spent.get(f"forwards_0@{n}")
    }
    v_loop = v_loop_n.get(k + 1, ratio(ratio(spent["forward_0"], spent["forwards_0"]), step_in_loop))
    # A v(n) the decode phase never verified prices no cycle there (0 cycles x anything).
    v_loop_by_cycles = [v_loop_n.get(j + 1, 0.0) for j in range(k + 1)]
    outside = {"rule": spent["rule"], "rollback": spent["rollback"], "stops": spent["stops"]}
    outside["rest (tensor glue, python)"] = spec_s - spent["forward"] - sum(outside.values())
    return {
        "alpha": alpha,
        "tokens_per_cycle": sum(len(cy.tokens) for cy in all_cycles) / len(all_cycles),
        "theoretical_tokens_per_cycle": metrics.expected_tokens_per_cycle(alpha, k),
        "cost_ratio": c,
        "verify_cost": v[k],
        "verify_costs": v,
        "target_step_s": costs["target_step_s"],
        "measured_speedup": measured,
        "measured_speedup_cv": measured_cv,  # over measured_speedup_per_rep: SPREAD_NOTE
        "measured_speedup_per_rep": speedups,
        **predictions(runs, alpha, k, c, v, v[k], measured),
        "in_loop": {
            "target_step_s": step_in_loop,
            "cost_ratio": c_loop,
            "verify_cost": v_loop,
            "verify_cost_by_positions": v_loop_n,  # {n: v(n)} from the loop's own verify passes
            "draft_forwards_per_drafted_token": spent["forwards_1"] / max(drafted, 1),
            **predictions(runs, alpha, k, c_loop, v_loop_by_cycles, v_loop, measured),
        },
        "spec_decode_s": spec_s,
        "base_decode_s": base_s,
        "spec_decode_tokens": spec_tokens,
        "base_decode_tokens": base_tokens,
        "overhead_fraction": 1 - ratio(spent["forward"], spec_s),
        "overhead_s": outside,
        "overhead_per_cycle_ms": 1000 * ratio(spec_s - spent["forward"], len(decode_cycles)),
        "decode_cycles": len(decode_cycles),
        **instrumented,
    }


def predictions(runs: list[dict], alpha: float, k: int, c: float, v: Sequence[float], v_k1: float, measured: float) -> dict:
    """The cost model's predictions under a run summary's names and meanings (harness.core.metrics):
    `predicted_speedup` priced on the cycles run after each prompt's first (`runs`: each speculative
    run's cycle_counts; v[j] = v(j + 1)), `predicted_speedup_formula` the closed form from alpha and
    v(k + 1) = `v_k1`, and the measured decode-phase speedup's `efficiency` against each."""
    by_cycles = metrics.predicted_by_cycles(runs, c, v)
    by_formula = metrics.predicted_speedup(alpha, k, c, v_k1)
    return {
        "predicted_speedup": by_cycles,
        "predicted_speedup_formula": by_formula,
        "efficiency": ratio(measured, by_cycles),
        "efficiency_formula": ratio(measured, by_formula),
    }


def plain_decode_speedup(pair, encoded, k: int, n: int, device, rep: int) -> float:
    """One pass over the prompts as `limit` makes it, with nothing instrumented: decode-phase
    tokens per second of speculative over target-only decoding (clock read at the first yield and the end)."""
    totals = [0, 0.0, 0, 0.0]  # spec tokens, spec s, base tokens, base s
    for i, ids in enumerate(encoded):
        for which in ("spec", "base") if (rep + i) % 2 == 0 else ("base", "spec"):
            if which == "spec":
                run = decode_phase(
                    speculative_decode(pair.target, pair.drafter, ids, k, GREEDY, n, pair.eos_ids, None),
                    device,
                    [],
                    Stopwatch(device),
                )
                totals[0] += sum(len(cy.tokens) for cy in run["items"][1:])
                totals[1] += run["decode_s"]
            else:
                run = decode_phase(
                    autoregressive_decode(pair.target, ids, GREEDY, n, pair.eos_ids, None), device, [], Stopwatch(device)
                )
                totals[2] += len(run["items"]) - 1
                totals[3] += run["decode_s"]
    return ratio(ratio(totals[0], totals[1]), ratio(totals[2], totals[3]))


def memory(pair, cfg, prompts, encoded, args, device) -> dict:
    """RSS (and CUDA allocated memory) after each prompt of a full baseline + speculative run."""
    cell = OmegaConf.merge(cfg, {"max_new_tokens": args.memory_new_tokens})
    sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))
    # Peaks over this run only: the process's own include loading (and a first run's GGUF dequantisation).
    since_reset = reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss, cuda = [], []
    for i in range(args.memory_prompts):
        run_prompt(pair, prompts[i % len(prompts)], encoded[i % len(prompts)], i, cell, sampling)
        rss.append(current_rss_mb())
        if device.type == "cuda":
            cuda.append(torch.cuda.memory_allocated(device) / 2**20)
    index = list(range(len(rss)))
    half = len(rss) // 2
    fit = stats.linregress(index[half:], rss[half:])  # after the allocator has settled
    out = {
        "prompts": len(rss),
        "distinct_prompts": min(len(prompts), len(rss)),
        "new_tokens": args.memory_new_tokens,
        "temperature": cell.temperature,
        "rss_mb": rss,
        "rss_first_mb": rss[0],
        "rss_last_mb": rss[-1],
        "rss_max_mb": max(rss),
        "rss_growth_mb_per_prompt_second_half": fit.slope,
        "rss_growth_stderr": fit.stderr,
    }
    out["peak_rss_mb"], out["peak_rss_over"] = peak_rss_mb(since_reset)  # over "cell": this run; "process": since start
    if cuda:
        out.update(
            cuda_allocated_mb=cuda,
            cuda_allocated_growth_mb=cuda[-1] - cuda[0],
            max_memory_allocated_mb=torch.cuda.max_memory_allocated(device) / 2**20,
        )
    return out


HF_ASSISTED_BATCH = (
    "HF assisted generation and prompt lookup refuse more than one sequence per generate() call, so at batch "
    "size > 1 only the baselines meet: our batched target-only decode against generate() on the same left-padded batch"
)


def hf_generate_batch(model, rows: list[torch.Tensor], max_new: int, eos: list[int]) -> list[list[int]]:
    """HF generate() on rows left-padded to one length with their attention mask (greedy); each row's
    new tokens, cut after its first EOS."""
    width = max(r.shape[0] for r in rows)
    ids = torch.full((len(rows), width), eos[0], dtype=torch.long, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[0] :], mask[i, width - r.shape[0] :] = r, 1
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
        )
    tokens = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        tokens.append(row[:cut])
    return tokens


def batched_baselines(pair, encoded, args, device) -> dict:
    """Part 5: at each of args.batch_sizes, our batched baseline (harness.core.loop) against HF generate()
    on the same left-padded batch of the first B prompts (repeated when fewer), interleaved (order
    alternating) over args.reps; tokens/s medians, the median of the per-rep ratios, and the share of
    rows whose greedy output is HF's (left padding and other product shapes may part them at a tie)."""
    from harness.models.batched import rows_of

    eos = sorted(pair.eos_ids)
    out: dict = {"note": HF_ASSISTED_BATCH}
    for size in args.batch_sizes:
        rows = [encoded[i % len(encoded)] for i in range(size)]
        target = rows_of(pair.target, size)
        target.reserve(max(r.shape[0] for r in rows) + args.max_new_tokens)

        def ours(rows=rows, target=target):
            tokens = [[] for _ in rows]
            gens = [torch.Generator(device) for _ in rows]
            for step in loop.autoregressive_decode_rows(target, rows, GREEDY, args.max_new_tokens, pair.eos_ids, gens):
                for row, token in step:
                    tokens[row].append(token)
            return tokens

        def theirs(rows=rows):
            return hf_generate_batch(pair.target.model, rows, args.max_new_tokens, eos)

        contenders = {"ours_base": ours, "hf_base": theirs}
        for fn in contenders.values():  # warm-up, excluded
            fn()
        rates, same = {name: [] for name in contenders}, 0
        for rep in range(args.reps):
            outputs = {}
            for name in list(contenders) if rep % 2 == 0 else list(reversed(contenders)):
                tokens, seconds = timed_call(contenders[name], device)
                outputs[name] = tokens
                rates[name].append(sum(map(len, tokens)) / seconds)
            same += sum(a == b for a, b in zip(outputs["ours_base"], outputs["hf_base"]))
        per_rep = [a / b for a, b in zip(rates["ours_base"], rates["hf_base"])]
        ratio_median, cv = median_and_cv(per_rep)
        out[str(size)] = {
            "tokens_per_s": {name: statistics.median(v) for name, v in rates.items()},
            "ratio": ratio_median,
            "ratio_cv": cv,
            "ratio_per_rep": per_rep,
            "same_output_as_hf": same / (args.reps * size),
        }
    return out
