"""The ship rule and its words: which candidate ships, the verdict, and what would change it.

Candidates are ranked by point estimate and the best one whose interval's
lower bound is above 1 ships; when that is not the top point estimate the
verdict names the higher, uncertain one. When no candidate's lower bound is
above 1 the decision is "ship no speculation". The best of another draft is
the runner-up, compared by the bootstrap ratio of their speedups and a
Wilcoxon signed-rank test (analysis.paired).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.names import CONTEXT_KEYS
from analysis.paired import Table, category_sums, interval, wilcoxon_p

NO_SPECULATION = "no speculation"


def select(candidates: list[dict], stats: list[tuple[float, float, float]]) -> tuple[dict, int, int | None]:
    """The ship rule over candidates with their (speedup, low, high): ranked by point estimate, the
    best whose lower bound is above 1 ships (none does: the top one is reported, no speculation).
    Returns the choice (best, the higher but uncertain `top` when that is another candidate, the
    best of another draft as runner-up, ship, k), best's index and the runner-up's."""
    order = sorted(range(len(candidates)), key=lambda i: -stats[i][0])
    best = next((i for i in order if stats[i][1] > 1), order[0])
    other = next((i for i in order if candidates[i]["label"] != candidates[best]["label"]), None)

    def brief(i: int) -> dict:
        return _brief(candidates[i], *stats[i])

    ships = stats[best][1] > 1
    choice = {
        "best": brief(best),
        "top": brief(order[0]) if order[0] != best else None,
        "runner_up": brief(other) if other is not None else None,
        "comparison": None,
        "ship": candidates[best]["label"] if ships else NO_SPECULATION,
        "k": candidates[best]["k"] if ships else None,
    }
    return choice, best, other


def choose(
    candidates: list[dict], replicates: np.ndarray, per_prompt: np.ndarray, prompts_used: np.ndarray, stat, confidence: float
) -> dict:
    """The candidate the ship rule picks (select), the best of another draft, their comparison, the verdict."""
    choice, best, other = select(candidates, [stat(c) for c in candidates])
    if other is not None:
        ratio = replicates[best] / replicates[other]  # [1 + n_resamples]
        rlo, rhi = interval(ratio[1:], confidence) if np.isfinite(choice["best"]["low"]) else (math.nan, math.nan)
        diffs = np.log(per_prompt[best, prompts_used]) - np.log(per_prompt[other, prompts_used])
        choice["comparison"] = {
            "ratio": float(ratio[0]),
            "low": rlo,
            "high": rhi,
            "p_bootstrap_not_better": float(np.mean(ratio[1:] <= 1)),
            "wilcoxon_p": wilcoxon_p(diffs),
            "prompts": int(prompts_used.sum()),
            "significant": bool(rlo > 1),
        }
    choice["verdict"] = verdict(choice, confidence)
    return choice


def _brief(c: dict, s: float, lo: float, hi: float) -> dict:
    return {"label": c["label"], "k": c["k"], "speedup": s, "low": lo, "high": hi}


def _f(x: float, fmt: str = ".3f") -> str:
    return "nan" if x is None or x != x else format(x, fmt)


def verdict(choice: dict, confidence: float) -> str:
    b, pct = choice["best"], f"{100 * confidence:g}%"
    interval = f"{_f(b['speedup'])}×" + (f" [{_f(b['low'])}, {_f(b['high'])}]" if b["low"] == b["low"] else "")
    if choice["ship"] == NO_SPECULATION:
        why = "lower bound ≤ 1" if b["low"] == b["low"] else "no interval: too few prompts"
        return (
            f"Ship no speculation: no draft beats the baseline with {pct} confidence "
            f"(best: {b['label']} k={b['k']}, speedup {interval}, {why})."
        )
    text = f"Ship {b['label']} with k={b['k']}: speedup {interval} ({pct} interval)."
    top, cmp, r = choice.get("top"), choice["comparison"], choice["runner_up"]
    if top:
        text += (
            f" {top['label']} k={top['k']} measures higher ({_f(top['speedup'])}× [{_f(top['low'])}, "
            f"{_f(top['high'])}]) but is not confidently faster than the baseline (lower bound ≤ 1)."
        )
    if cmp:
        rel = (
            f"{b['label']} vs {r['label']} (k={r['k']}): ratio {_f(cmp['ratio'])} [{_f(cmp['low'])}, {_f(cmp['high'])}], "
            f"Wilcoxon p = {_f(cmp['wilcoxon_p'], '.3g')} over {cmp['prompts']} prompts"
        )
        if cmp["significant"]:
            text += f" It beats the runner-up: {rel}."
        elif r["low"] > 1:
            text += f" Not distinguishable from the runner-up: {rel}; either is defensible."
        elif top and (top["label"], top["k"]) == (r["label"], r["k"]):
            text += f" Compared with it: {rel}."
        else:
            text += (
                f" Not distinguishable from the runner-up: {rel}; but {r['label']} k={r['k']} is not "
                f"confidently faster than the baseline (lower bound ≤ 1)."
            )
    return text


def what_would_change(
    decision: dict, table: Table, names: list[str], w: np.ndarray, fits: pd.DataFrame | None, cells: pd.DataFrame
) -> list[str]:
    """Plain sentences: how far each input is from flipping the mix decision."""
    mix, out = decision["mix"], []
    best, runner, cmp = mix["best"], mix["runner_up"], mix["comparison"]
    n = decision["prompts"]
    # Sampling noise: prompts needed to resolve the top two (interval half-width scales as 1/sqrt(n)).
    if cmp and not cmp["significant"] and cmp["ratio"] > 0 and all(np.isfinite([cmp["low"], cmp["high"]])):
        half = (math.log(cmp["high"]) - math.log(max(cmp["low"], 1e-12))) / 2
        effect = abs(math.log(cmp["ratio"]))
        if effect > 0:
            out.append(
                f"More prompts: {best['label']} and {runner['label']} differ by {100 * (cmp['ratio'] - 1):+.1f}%; "
                f"about {math.ceil(n * (half / effect) ** 2)} prompts (now {n}) would separate a difference that size."
            )
    if mix["ship"] == NO_SPECULATION and np.isfinite(best["low"]) and best["speedup"] > 0:
        half = (math.log(max(best["high"], 1e-12)) - math.log(max(best["low"], 1e-12))) / 2
        gain = math.log(best["speedup"])
        if gain > 0:
            out.append(
                f"More prompts: {best['label']} k={best['k']} measures {best['speedup']:.3f}×; about "
                f"{math.ceil(n * (half / gain) ** 2)} prompts (now {n}) would show whether it beats the baseline."
            )
    # Traffic mix: the share of one category at which the runner-up overtakes.
    if runner is not None and len(names) > 1:
        i = table.candidates.index((best["label"], best["k"]))
        j = table.candidates.index((runner["label"], runner["k"]))
        counts = np.ones((1, len(table.prompt_keys)))
        sums = category_sums(table, counts, names)
        for g_index, g in enumerate(names):
            flip = _flip_share(sums, i, j, w, g_index)
            if flip is not None:
                out.append(
                    f"Traffic: if {g} rises from {100 * w[g_index]:.0f}% to {100 * flip:.0f}% of the tokens, "
                    f"{runner['label']} k={runner['k']} overtakes {best['label']} (point estimates)."
                )
    # The fitted model: an unmeasured k, or the costs at which the draft stops paying.
    if fits is not None and not fits.empty:
        label = best["label"]
        rows = fits[(fits["label"] == label) & (fits[CONTEXT_KEYS] == [decision[k] for k in CONTEXT_KEYS]).all(axis=1)]
        for _, f in rows.iterrows():
            measured = {int(k) for k in f["ks"].split()}
            if f["best_k"] and f["best_k"] not in measured and f["predicted_best"] > 1:  # one that would lose changes nothing
                out.append(
                    f"Unmeasured k ({f['dataset']}): the fit puts {label}'s best k at {f['best_k']} "
                    f"(predicted {f['predicted_best']:.3f}×, measured k: {f['ks']}); run k={f['best_k']} to confirm."
                )
            where = f"Costs (fitted model, {f['dataset']}): {label}"
            if f["alpha"] != f["alpha"]:  # NaN: no drafted position was ever tested
                out.append(
                    f"{where}: α is unknown (no drafted token was ever verified, e.g. a prompt lookup that never "
                    f"matched), so the model cannot say what a cheaper draft would give."
                )
                continue
            if not f["break_even_cost_ratio"] > 0:
                out.append(
                    f"{where}: at α = {_f(f['alpha'])} and the measured verify cost (b = {_f(f['verify_slope'])}) "
                    f"even a free draft (c = 0) predicts no speedup above 1; only a cheaper verify pass would."
                )
                continue
            at_c = (
                f"at this c, while α ≥ {_f(f['break_even_alpha'])}"
                if f["break_even_alpha"] == f["break_even_alpha"]
                else "at this c no α does"
            )
            out.append(
                f"{where} pays off (predicted speedup > 1 at some k ≤ {f['max_k']}) while c ≤ "
                f"{_f(f['break_even_cost_ratio'])} (measured c = {_f(f['cost_ratio'])}) and, {at_c} "
                f"(measured α = {_f(f['alpha'])})."
            )
    return out


def _flip_share(sums: dict, i: int, j: int, w: np.ndarray, g: int) -> float | None:
    """Smallest share of category g (moving weight to g from the others, proportionally)
    at which candidate j's mix speedup exceeds candidate i's; None if it never does."""
    tau_spec = sums["spec_time"][:, 0] / sums["spec_tokens"][:, 0]  # [c, g]
    tau_base = sums["base_time"][:, 0] / sums["base_tokens"][:, 0]
    for t in np.linspace(0, 1, 201):
        wt = (1 - t) * w + t * np.eye(len(w))[g]
        s = (tau_base @ wt) / (tau_spec @ wt)
        if s[j] > s[i]:
            return None if t == 0 else float(wt[g])
    return None
