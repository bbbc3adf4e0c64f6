"""Metrics: every number the harness reports, each defined once, here (definitions: docs/metrics.md).

Per prompt, the loop's cycles are reduced to counts (`cycle_counts`); the summary is derived from
those counts and the paired timings only, so a results file can always be re-summarised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from scipy import stats

if TYPE_CHECKING:  # annotations only: the report imports metrics without torch
    from harness.core.loop import Cycle


def cycle_counts(cycles: Sequence[Cycle], k: int) -> dict:
    """The raw counts one prompt's cycles reduce to (all later metrics derive from these)."""
    hist, drafted_hist = [0] * (k + 1), [0] * (k + 1)
    reached, kept = [0] * k, [0] * k
    expected_sum, tested = 0.0, 0
    for c in cycles:
        hist[c.num_accepted] += 1
        drafted_hist[c.num_drafted] += 1
        betas = c.expected_acceptance.tolist()  # one per tested position
        for i in range(len(betas)):
            reached[i] += 1
            kept[i] += i < c.num_accepted
        expected_sum += sum(betas)
        tested += len(betas)
    trees = {}
    if any(c.nodes for c in cycles):  # token trees: each pass verifies a tree's nodes, priced at that width
        widths = [c.nodes or c.num_drafted for c in cycles]
        ranks = [r for c in cycles for r in c.ranks]
        trees = {
            "verified_hist": [widths.count(n) for n in range(max(max(widths), k) + 1)],  # cycles by nodes verified
            "first_verified": widths[0],
            "sibling_accepted": [ranks.count(r) for r in range(max(ranks, default=-1) + 1)],  # accepted nodes by place
        }
    return {
        **trees,
        "cycles": len(cycles),
        "committed": sum(len(c.tokens) for c in cycles),
        "drafted": sum(c.num_drafted for c in cycles),
        "drafted_after_eos": sum(c.num_after_eos for c in cycles),  # drafted, then cut by an accepted EOS
        "accepted": sum(c.num_accepted for c in cycles),
        "tested": tested,
        "expected_sum": expected_sum,
        "accept_hist": hist,
        "drafted_hist": drafted_hist,  # [k + 1] cycles that drafted 0..k tokens
        # The first cycle is also the prompt's pass: decode figures (TPOT, decode_speedup) leave it out.
        "first_drafted": cycles[0].num_drafted if cycles else 0,
        "first_committed": len(cycles[0].tokens) if cycles else 0,
        "position_reached": reached,
        "position_accepted": kept,
    }


def ratio(a: float, b: float) -> float:
    """a / b, nan when b is 0 (nothing to divide by: no cycles, no drafts)."""
    return a / b if b else float("nan")


def acceptance_rate(counts: dict) -> float:
    """Accepted drafted tokens / drafted tokens, leaving out drafts after an accepted EOS (never to be kept)."""
    return ratio(counts["accepted"], counts["drafted"] - counts.get("drafted_after_eos", 0))


def expected_tokens_per_cycle(alpha: float, k: int) -> float:
    """Leviathan et al. eq. (1): E[tokens per cycle] with i.i.d. acceptance alpha."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float) -> float:
    """Expected tokens per cycle over its cost in target steps: k draft steps of c, one verify pass of v(k+1)."""
    return expected_tokens_per_cycle(alpha, k) / (k * cost_ratio + verify_cost)


GRID_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)  # the acceptance rates a cost-only cell predicts at


def predicted_grid(costs: dict, alphas: Sequence[float] = GRID_ALPHAS) -> dict:
    """Predicted speedup at each acceptance rate and each k the measured v(n) covers (v(k + 1) known), and the
    best k per rate: what a draft of these costs would give (a cost-only cell's answer)."""
    c, v = costs["cost_ratio"], costs["verify_cost"]
    ks = list(range(1, len(v)))
    speedup = [[predicted_speedup(alpha, k, c, v[k]) for k in ks] for alpha in alphas]
    return {"alpha": list(alphas), "k": ks, "speedup": speedup, "best_k": [ks[row.index(max(row))] for row in speedup]}


def _bootstrap(columns: Sequence[np.ndarray], statistic, seed: int) -> tuple[float, float]:
    if len(columns[0]) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    res = stats.bootstrap(
        columns, statistic, paired=True, vectorized=True, n_resamples=2000, confidence_level=0.95, method="percentile", rng=rng
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def speedup_stats(records: Sequence[dict], seed: int = 0) -> dict:
    """Paired speedup over prompts: ratio of totals and geometric mean, with CIs."""
    sides = [(side, key) for side in ("spec", "base") for key in ("new_tokens", "time_s")]
    cols = tuple(np.array([r[side][key] for r in records], dtype=float) for side, key in sides)

    def ratio_of_totals(st, stt, bt, btt, axis=-1):
        return (st.sum(axis) / stt.sum(axis)) / (bt.sum(axis) / btt.sum(axis))

    def geomean(st, stt, bt, btt, axis=-1):
        return np.exp(np.mean(np.log((st / stt) / (bt / btt)), axis=axis))

    return {
        "speedup": float(ratio_of_totals(*cols)),
        "speedup_ci": _bootstrap(cols, ratio_of_totals, seed),
        "speedup_geomean": float(geomean(*cols)),
        "speedup_geomean_ci": _bootstrap(cols, geomean, seed),
    }


def batch_units(records: Sequence[dict]) -> list[dict]:
    """The batches (batch_size > 1) the records' prompts ran in, once each, in order: their own tokens,
    times and clocks (harness.runner.cell.run_batch). Without batches, the records themselves."""
    if not records or "batch" not in records[0]:
        return list(records)
    return list({r["batch"]["index"]: r["batch"] for r in records}.values())


def summarize(records: Sequence[dict], k: int, costs: dict, seed: int = 0) -> dict:
    """Summary metrics of a run from its per-prompt records and measured costs. At batch_size > 1 the
    counts are the prompts' and the times, speedups and in-run costs the batches' (`batch_units`)."""
    units = batch_units(records)
    total = lambda key: sum(r["spec"][key] for r in records)  # noqa: E731
    hist = np.sum([r["spec"]["accept_hist"] for r in records], axis=0).tolist() if records else [0] * (k + 1)
    reached = np.sum([r["spec"]["position_reached"] for r in records], axis=0) if records else np.zeros(k)
    kept = np.sum([r["spec"]["position_accepted"] for r in records], axis=0) if records else np.zeros(k)
    alpha = ratio(total("accepted"), total("tested"))
    c, v = costs["cost_ratio"], costs["verify_cost"][k]  # verify_cost[n - 1] = v(n)
    by_formula = predicted_speedup(alpha, k, c, v) if not math.isnan(alpha) else float("nan")
    predicted = predicted_by_cycles(records, c, costs["verify_cost"])
    after_eos = sum(r["spec"].get("drafted_after_eos", 0) for r in records)
    summary = {
        "num_prompts": len(records),
        "acceptance_rate": acceptance_rate(
            {"accepted": total("accepted"), "drafted": total("drafted"), "drafted_after_eos": after_eos}
        ),
        "alpha": alpha,
        "expected_alpha": ratio(total("expected_sum"), total("tested")),
        "position_acceptance": [ratio(a, b) for a, b in zip(kept.tolist(), reached.tolist())],
        "accept_hist": hist,
        "cycles_without_draft": sum((r["spec"].get("drafted_hist") or [0])[0] for r in records),  # in accept_hist[0] too
        # [k + 1] cycles that drafted 0..k tokens (a batch: its widest row), and the mean: a draft-length policy's choice
        "drafted_hist": np.sum([r["spec"]["drafted_hist"] for r in records], axis=0).tolist() if records else [0] * (k + 1),
        "mean_drafted": ratio(total("drafted"), total("cycles")),
        "tokens_per_cycle": ratio(total("committed"), total("cycles")),
        "accepted_per_cycle": ratio(total("accepted"), total("cycles")),
        "theoretical_tokens_per_cycle": expected_tokens_per_cycle(alpha, k) if not math.isnan(alpha) else float("nan"),
        "target_passes": total("cycles"),
        "draft_passes": total("draft_passes"),
        "cycles": total("cycles"),
        "new_tokens": total("new_tokens"),
        "base_new_tokens": sum(r["base"]["new_tokens"] for r in records),
        "spec_time_s": sum(u["spec"]["time_s"] for u in units),
        "base_time_s": sum(u["base"]["time_s"] for u in units),
        "spec_ttft_s": float(np.median([r["spec"]["ttft_s"] for r in records])) if records else float("nan"),
        "base_ttft_s": float(np.median([r["base"]["ttft_s"] for r in records])) if records else float("nan"),
        "spec_tpot_s": _tpot(units, "spec"),
        "base_tpot_s": _tpot(units, "base"),
        **cost_figures(costs, k),
        "predicted_speedup": predicted,
        "predicted_speedup_formula": by_formula,
    }
    if records and "verified_hist" in records[0]["spec"]:  # token trees: nodes verified, accepted nodes by sibling place
        summary["verified_hist"] = _summed([r["spec"]["verified_hist"] for r in records])
        summary["mean_verified"] = ratio(sum(n * w for w, n in enumerate(summary["verified_hist"])), total("cycles"))
        summary["sibling_accepted"] = _summed([r["spec"]["sibling_accepted"] for r in records])
    summary["spec_tokens_per_s"] = ratio(summary["new_tokens"], summary["spec_time_s"])
    summary["base_tokens_per_s"] = ratio(summary["base_new_tokens"], summary["base_time_s"])
    if records and "batch" in records[0]:
        summary["batches"] = len(units)
    if records:
        summary.update(speedup_stats(units, seed))
    else:
        nan = float("nan")
        summary.update(speedup=nan, speedup_ci=(nan, nan), speedup_geomean=nan, speedup_geomean_ci=(nan, nan))
    summary["decode_speedup"] = ratio(summary["base_tpot_s"], summary["spec_tpot_s"])
    in_run = in_run_costs(units, k)
    in_run_predicted = predicted_by_cycles(
        records, in_run["cost_ratio"], [0.0 if math.isnan(x) else x for x in in_run["verify_cost"]]
    )  # a v(n) the run never paid prices no cycle (0 cycles x anything)
    summary.update(
        in_run=in_run,
        predicted_speedup_in_run=in_run_predicted,
        efficiency=ratio(summary["decode_speedup"], in_run_predicted),  # the headline: costs and speedup on one clock
        efficiency_isolated=ratio(summary["decode_speedup"], predicted),  # a diagnostic: costs timed apart
        efficiency_formula=ratio(summary["decode_speedup"], by_formula),
    )
    return summary


def cost_figures(costs: dict, k: int) -> dict:
    """The measured costs a summary quotes: c, v(k + 1), the target's and the draft's step, with intervals."""
    return {
        "cost_ratio": costs["cost_ratio"],
        "cost_ratio_ci": costs.get("cost_ratio_ci"),
        "verify_cost": costs["verify_cost"][k],
        "verify_cost_ci": (costs.get("verify_cost_ci") or [None] * (k + 1))[k],
        "verify_cost_dips": costs.get("verify_cost_dips", []),  # n where v(n) is clearly below an earlier v: see the table
        "target_step_s": costs.get("target_step_s"),
        "target_step_s_ci": costs.get("target_step_s_ci"),
        "draft_step_s": costs.get("draft_step_s"),
        "draft_step_s_ci": costs.get("draft_step_s_ci"),
    }


def in_run_costs(records: Sequence[dict], k: int) -> dict:
    """The cost model's inputs timed inside the run (harness.runner.costs.Clock), after each prompt's first
    yield: the target step (the baseline's passes), c (the draft's proposals per drafted token, over a step)
    and v(n) (verify passes over n positions, over a step; nan where the run had none)."""

    def clocked(side: str, key: str) -> tuple[float, int]:
        entries = [r[side].get("clock", {}).get(key, (0.0, 0)) for r in records]
        return sum(e[0] for e in entries), sum(e[1] for e in entries)

    step = ratio(*clocked("base", "verify@1"))
    widest = max([k] + [len(r["spec"].get("verified_hist", [])) - 1 for r in records])  # a token tree's passes are wider
    drafted = sum(r["spec"]["drafted"] - r["spec"]["first_drafted"] for r in records)
    draft_s, _ = clocked("spec", "draft")
    return {
        "target_step_s": step,
        "cost_ratio": ratio(ratio(draft_s, drafted), step) if drafted else 0.0,  # nothing drafted: no draft cost to price
        "verify_cost": [ratio(ratio(*clocked("spec", f"verify@{n}")), step) for n in range(1, widest + 2)],  # v(1..k+1), or wider
    }


def predicted_by_cycles(records: Sequence[dict], c: float, v: Sequence[float]) -> float:
    """Committed tokens over what the cycles run cost in target steps (v[j] = v(j + 1)), after each prompt's
    first cycle (its prompt pass). At batch_size > 1, priced per batch (`batch_passes`)."""
    if not records:
        return float("nan")
    if "batch" in records[0] and "drafted_hist" in records[0]["batch"]["spec"]:
        return batch_passes(batch_units(records), c, v)
    cycles = np.sum([r["spec"]["drafted_hist"] for r in records], axis=0)  # [k + 1] cycles that drafted 0..k
    committed = sum(r["spec"]["committed"] for r in records)
    for r in records:
        cycles[r["spec"]["first_drafted"]] -= 1
        committed -= r["spec"]["first_committed"]
    if "verified_hist" not in records[0]["spec"]:
        return ratio(committed, cycles_cost(cycles, c, v))
    widest = max(len(r["spec"]["verified_hist"]) for r in records)
    passes = np.sum([np.pad(r["spec"]["verified_hist"], (0, widest - len(r["spec"]["verified_hist"]))) for r in records], axis=0)
    for r in records:
        passes[r["spec"]["first_verified"]] -= 1
    return ratio(committed, cycles_cost(cycles, c, v, passes))


def cycles_cost(cycles: np.ndarray, c: float, v: Sequence[float], passes: np.ndarray | None = None) -> float:
    """Target steps that cycles[j] cycles drafting j tokens each cost: j draft steps (c) and a pass of j + 1 positions.
    Token trees: cycles[j] drafted j levels (a draft step each) and passes[n] passes verified n nodes (v(n + 1))."""
    if passes is None:
        return sum(n * (j * c + v[j]) for j, n in enumerate(cycles.tolist()))
    return sum(n * j * c for j, n in enumerate(cycles.tolist())) + sum(n * v[w] for w, n in enumerate(passes.tolist()) if n)


def batch_passes(units: Sequence[dict], c: float, v: Sequence[float]) -> float:
    """The prediction at batch_size > 1, from the batches' passes after their first yield: a cycle is k'
    batched draft steps and one pass of k' + 1 positions (k' the most any row drafted), a baseline step one
    step; (spec tokens / spec cost) over (baseline tokens / baseline steps)."""
    cycles = np.sum([u["spec"]["drafted_hist"] for u in units], axis=0)  # [k + 1] passes by their widest draft
    for u in units:
        cycles[u["spec"]["first_drafted"]] -= 1
    spec = ratio(sum(u["spec"]["new_tokens"] - u["spec"]["first_tokens"] for u in units), cycles_cost(cycles, c, v))
    base = ratio(
        sum(u["base"]["new_tokens"] - u["base"]["first_tokens"] for u in units), sum(u["base"]["steps"] - 1 for u in units)
    )
    return ratio(spec, base)


def _summed(lists: Sequence[list[int]]) -> list[int]:
    """Histograms of different lengths, summed."""
    out = [0] * max(map(len, lists), default=0)
    for values in lists:
        for i, n in enumerate(values):
            out[i] += n
    return out


def median_ci(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics whose binomial coverage is at
    least `confidence` (9 samples: the 2nd and 8th, 96%); nan when too few samples reach it."""
    x = np.sort(np.asarray(samples, dtype=float))
    n = len(x)
    for j in range(n // 2, 0, -1):  # widen from the middle until the coverage suffices
        if stats.binom.cdf(n - j, n, 0.5) - stats.binom.cdf(j - 1, n, 0.5) >= confidence:  # P(x_(j) <= median <= x_(n-j+1))
            return float(x[j - 1]), float(x[n - j])
    return float("nan"), float("nan")


def _tpot(records: Sequence[dict], side: str) -> float:
    """Time per output token after the first yield: (time - TTFT) / (tokens - first yield's tokens)."""
    num = sum(r[side]["time_s"] - r[side]["ttft_s"] for r in records)
    den = sum(r[side]["new_tokens"] - r[side]["first_tokens"] for r in records)
    return ratio(num, den)


def by_category(records: Sequence[dict], k: int, costs: dict, seed: int = 0) -> dict[str, dict]:
    cats = sorted({r["category"] for r in records})
    return {cat: summarize([r for r in records if r["category"] == cat], k, costs, seed) for cat in cats}
