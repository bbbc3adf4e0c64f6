"""The fitted model behind a sweep: alpha, c and v(n) per (target, run setup, draft, dataset, sampling).

The run setup (analysis.names.CONDITION_KEYS: device, dtype, max_new_tokens,
cache, compile) is part of a fit's key: c and v are the machine's, and
pooling an A100's cells with an H100's would fit neither.

Leviathan et al.'s model of a speculative cycle (harness.core.metrics):

    S(k) = E[tokens per cycle] / cycle cost = ((1 - a^(k+1)) / (1 - a)) / (k c + v(k+1))

  a (alpha)  P(a drafted position is accepted | the earlier ones were):
             accepted / tested positions, pooled over the group's prompts
             and k. Positions within a prompt are correlated (easy prompts
             accept runs of tokens), so its interval is a cluster bootstrap
             over prompts: prompts are resampled whole, with all their
             positions at every k (scipy.stats.bootstrap, percentile).
  c          draft step / target step, each cell's measured `cost_ratio`;
             the group's value is their median.
  v(n)       target time to score n positions in one pass / one decode step
             (v(1) = 1 by definition). Fitted as v(n) = 1 + b (n - 1), a
             line through (1, 1) whose slope b >= 0 is the median of the
             slopes of every cell's measured points, then extrapolated to
             n = 17. On a GPU v(n) is flat
             while the pass is memory-bound and then rises, so a line over
             small n is optimistic far beyond the measured range; the fits
             table says how far the measurements went.

alpha does not depend on the hardware, c and v do: `whatif` re-predicts
S(k) with another machine's costs, so a sweep on one machine informs a
choice for another. The interval of S(k) carries the uncertainty of alpha
only (S is increasing in alpha, so it is S at alpha's bounds); c and v are
medians of repeated timings, and their error is small next to alpha's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import optimize, stats

from harness.core.metrics import expected_tokens_per_cycle
from harness.core.metrics import predicted_speedup as leviathan_speedup

MAX_K = 16
FIT_KEYS = ["target", "setup", "label", "dataset", "sampling"]


def predicted_speedup(alpha: float, k: int, cost_ratio: float, verify_slope: float) -> float:
    """S(k) with the fitted verify cost v(k + 1) = 1 + b k."""
    if not (alpha == alpha and cost_ratio == cost_ratio):
        return math.nan
    return leviathan_speedup(alpha, k, cost_ratio, 1.0 + verify_slope * k)


def speedup_curve(alpha: float, cost_ratio: float, verify_slope: float, max_k: int = MAX_K) -> np.ndarray:
    """[max_k] S(k) for k = 1..max_k."""
    return np.array([predicted_speedup(alpha, k, cost_ratio, verify_slope) for k in range(1, max_k + 1)])


def best_k(alpha: float, cost_ratio: float, verify_slope: float, max_k: int = MAX_K) -> tuple[int, float]:
    """argmax_k S(k) over 1..max_k, and S there."""
    curve = speedup_curve(alpha, cost_ratio, verify_slope, max_k)
    if np.all(np.isnan(curve)):
        return 0, math.nan
    i = int(np.nanargmax(curve))
    return i + 1, float(curve[i])


def verify_slope(points: list[tuple[int, float]]) -> float:
    """b of v(n) = 1 + b (n - 1): the median of the points' slopes (v(n) - 1) / (n - 1), clipped at 0.

    A line through (1, 1), fitted robustly: one timing hiccup (a busy
    machine, a page fault) in one cell moves a least-squares slope a lot
    and the median hardly at all."""
    n = np.array([p[0] for p in points], dtype=float)
    v = np.array([p[1] for p in points], dtype=float)
    keep = (n > 1) & np.isfinite(v)
    if not keep.any():
        return 0.0
    return max(0.0, float(np.median((v[keep] - 1) / (n[keep] - 1))))


@dataclass
class Interval:
    value: float
    low: float
    high: float
    method: str


def alpha_interval(
    accepted: np.ndarray, tested: np.ndarray, confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> Interval:
    """Pooled alpha = sum accepted / sum tested over clusters (prompts), with a cluster-bootstrap interval.

    Clusters that tested no position (prompt lookup never matched) add nothing to alpha and are left
    out: a resample of only those would be 0/0, and one NaN replicate makes scipy's interval NaN."""
    accepted, tested = np.asarray(accepted, dtype=float), np.asarray(tested, dtype=float)
    idle = int((tested <= 0).sum())
    accepted, tested = accepted[tested > 0], tested[tested > 0]
    total = tested.sum()
    if total <= 0:
        return Interval(math.nan, math.nan, math.nan, "none")
    alpha = float(accepted.sum() / total)
    if len(tested) < 2:
        return binomial_interval(accepted.sum(), total, confidence)

    def pooled(a, t, axis=-1):
        return a.sum(axis) / t.sum(axis)

    res = stats.bootstrap(
        (accepted, tested),
        pooled,
        paired=True,
        vectorized=True,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return Interval(
        alpha,
        float(res.confidence_interval.low),
        float(res.confidence_interval.high),
        f"cluster bootstrap over {len(tested)} prompts" + (f" ({idle} that tested nothing left out)" if idle else ""),
    )


def binomial_interval(accepted: float, tested: float, confidence: float = 0.95) -> Interval:
    """Wilson interval, positions taken as independent (too narrow: use only without per-prompt rows)."""
    n, x = int(round(tested)), int(round(accepted))
    if n <= 0:
        return Interval(math.nan, math.nan, math.nan, "none")
    ci = stats.binomtest(min(x, n), n).proportion_ci(confidence_level=confidence, method="wilson")
    return Interval(accepted / tested, float(ci.low), float(ci.high), "Wilson (positions independent)")


def break_even_cost_ratio(alpha: float, verify_slope: float, max_k: int = MAX_K) -> float:
    """The largest c at which some k <= max_k still gives S(k) >= 1: max_k (E_k - 1 - b k) / k."""
    if alpha != alpha:
        return math.nan
    return max((expected_tokens_per_cycle(alpha, k) - 1 - verify_slope * k) / k for k in range(1, max_k + 1))


def break_even_alpha(cost_ratio: float, verify_slope: float, max_k: int = MAX_K) -> float:
    """The smallest alpha at which some k <= max_k gives S(k) >= 1 (NaN: none does, even at alpha -> 1)."""

    def gap(a: float) -> float:
        return best_k(a, cost_ratio, verify_slope, max_k)[1] - 1

    hi = 1 - 1e-9
    if cost_ratio != cost_ratio or gap(hi) < 0:
        return math.nan
    if gap(0.0) >= 0:
        return 0.0
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-6))


def fit(
    cells: pd.DataFrame,
    prompts: pd.DataFrame,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    max_k: int = MAX_K,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(fits: one row per group, curves: one row per group x k = 1..max_k)."""
    fits, curves = [], []
    for key, group in cells.groupby(FIT_KEYS, sort=True):
        row = dict(zip(FIT_KEYS, key))
        alpha = _group_alpha(group, prompts, confidence, n_resamples, seed)
        c = float(group["cost_ratio"].median())
        points = [(n + 1, v) for costs in group["verify_costs"] for n, v in enumerate(costs)]
        b = verify_slope(points)
        k_best, s_best = best_k(alpha.value, c, b, max_k)
        measured = group.loc[group["speedup"].idxmax()] if group["speedup"].notna().any() else None
        row.update(
            draft_kind=group["draft_kind"].iloc[0],
            target_arch=group["target_arch"].iloc[0] if "target_arch" in group else None,
            draft_arch=group["draft_arch"].iloc[0] if "draft_arch" in group else None,
            batch_size=int(group["batch_size"].iloc[0]) if "batch_size" in group else 1,
            temperature=float(group["temperature"].iloc[0]),
            cells=len(group),
            ks=" ".join(str(k) for k in sorted(group["k"])),
            prompts=int(group["num_prompts"].max()) if group["num_prompts"].notna().any() else 0,
            alpha=alpha.value,
            alpha_low=alpha.low,
            alpha_high=alpha.high,
            alpha_method=alpha.method,
            cost_ratio=c,
            target_step_s=float(group["target_step_s"].median()),
            draft_step_s=float(group["draft_step_s"].median()),
            verify_slope=b,
            verify_max_n=max((n for n, _ in points), default=0),
            best_k=k_best,
            predicted_best=s_best,
            predicted_best_low=predicted_speedup(alpha.low, k_best, c, b) if k_best else math.nan,
            predicted_best_high=predicted_speedup(alpha.high, k_best, c, b) if k_best else math.nan,
            measured_best_k=int(measured["k"]) if measured is not None else 0,
            measured_best_speedup=float(measured["speedup"]) if measured is not None else math.nan,
            efficiency=float(group["efficiency"].median()),
            break_even_cost_ratio=break_even_cost_ratio(alpha.value, b, max_k),
            break_even_alpha=break_even_alpha(c, b, max_k),
            max_k=max_k,
            draft_params=float(group["draft_params"].iloc[0]),
            draft_bytes=float(group["draft_bytes"].iloc[0]),
        )
        fits.append(row)
        for k in range(1, max_k + 1):
            curves.append(
                {
                    **dict(zip(FIT_KEYS, key)),
                    "k": k,
                    "predicted": predicted_speedup(alpha.value, k, c, b),
                    "low": predicted_speedup(alpha.low, k, c, b),
                    "high": predicted_speedup(alpha.high, k, c, b),
                }
            )
    return pd.DataFrame(fits), pd.DataFrame(curves)


def _group_alpha(group: pd.DataFrame, prompts: pd.DataFrame, confidence: float, n_resamples: int, seed: int) -> Interval:
    """Cluster bootstrap when every cell has per-prompt rows; else Wilson on the cells' counts."""
    if group["has_prompts"].all() and not prompts.empty:
        rows = prompts[prompts["cell"].isin(group["cell"])]
        clusters = rows.groupby("prompt_key")[["spec_accepted", "spec_tested"]].sum()
        return alpha_interval(
            clusters["spec_accepted"].to_numpy(), clusters["spec_tested"].to_numpy(), confidence, n_resamples, seed
        )
    return binomial_interval(group["accepted_total"].sum(), group["tested_total"].sum(), confidence)


# What-if: the same alpha, another machine's costs.


@dataclass
class WhatIf:
    """Costs on another machine. Each of cost_ratio and draft_step_ms is one number for every
    model draft, or {draft label: number}; target_step_ms is one number."""

    name: str = "other hardware"
    cost_ratio: float | dict | None = None
    target_step_ms: float | None = None
    draft_step_ms: float | dict | None = None
    verify_slope: float | None = None  # b on that machine; None keeps the measured one
    ridge_rows: float | None = None  # rows per pass where a step there turns compute-bound (batch_crossover)

    def given(self) -> bool:
        return any(
            v not in (None, {})
            for v in (self.cost_ratio, self.target_step_ms, self.draft_step_ms, self.verify_slope, self.ridge_rows)
        )

    def cost_for(self, fit_row: pd.Series) -> tuple[float, str]:
        """(c on that machine, where it came from) for one fitted group."""
        label, kind = fit_row["label"], fit_row["draft_kind"]
        c = _pick(self.cost_ratio, label, kind)
        if c is not None:
            return float(c), "given c"
        draft_ms = _pick(self.draft_step_ms, label, kind)
        if draft_ms is not None and self.target_step_ms:
            return float(draft_ms) / float(self.target_step_ms), "given step times"
        if kind == "ngram" and self.target_step_ms:
            # Prompt lookup runs on the host: its time does not move with the accelerator.
            return 1e3 * float(fit_row["draft_step_s"]) / float(self.target_step_ms), "measured lookup time / given target step"
        return float(fit_row["cost_ratio"]), "measured c kept (none given)"


def _pick(value, label: str, kind: str):
    if isinstance(value, dict):
        return value.get(label)
    return value if kind == "model" else None


BATCH_SIZES = tuple(2**i for i in range(11))  # the what-if's batch sizes, 1..1024


def batch_speedup(
    alpha: float, cost_ratio: float, verify_slope: float, ridge: float, batch: int, kind: str, max_k: int
) -> tuple[int, float]:
    """(best k, predicted speedup) at batch size `batch` on a machine whose passes are memory-bound up to
    `ridge` rows: a pass of r rows over n positions each costs max(1 + b (n - 1), r n / ridge) one-row steps,
    so v_B(n) = max(1 + b (n - 1), B n / ridge) / max(1, B / ridge). A draft model or head shares the
    machine's roofline (its c holds); prompt lookup runs on the host once per row (c grows as B / max(1, B / ridge))."""
    step = max(1.0, batch / ridge)
    c = cost_ratio * batch / step if kind == "ngram" else cost_ratio
    best = (0, 1.0)
    for k in range(1, max_k + 1):
        v = max(1.0 + verify_slope * k, batch * (k + 1) / ridge) / step
        s = leviathan_speedup(alpha, k, c, v)
        if s > best[1]:
            best = (k, s)
    return best


def batch_crossover(alpha: float, cost_ratio: float, verify_slope: float, ridge: float, kind: str, max_k: int) -> int | None:
    """The largest of BATCH_SIZES up to which some k predicts a speedup above 1 at every size (None: not at 1)."""
    last = None
    for batch in BATCH_SIZES:
        if batch_speedup(alpha, cost_ratio, verify_slope, ridge, batch, kind, max_k)[1] <= 1.0:
            break
        last = batch
    return last


def whatif(fits: pd.DataFrame, spec: WhatIf, max_k: int = MAX_K) -> pd.DataFrame:
    """Predicted best k and speedup under `spec`'s costs, with alpha's interval, one row per fit; with
    `ridge_rows`, up to which batch size the draft pays there (fits measured at batch size 1 only: the
    costs the roofline scales are one-row costs)."""
    rows = []
    for _, f in fits.iterrows():
        c, source = spec.cost_for(f)
        b = f["verify_slope"] if spec.verify_slope is None else float(spec.verify_slope)
        k, s = best_k(f["alpha"], c, b, max_k)
        crossover = {}
        if spec.ridge_rows and int(f.get("batch_size", 1)) == 1:
            ridge, kind = float(spec.ridge_rows), f["draft_kind"]
            crossover = {
                "ridge_rows": ridge,
                "pays_up_to_batch": batch_crossover(f["alpha"], c, b, ridge, kind, max_k),
                "pays_up_to_batch_low": batch_crossover(f["alpha_low"], c, b, ridge, kind, max_k),
                "pays_up_to_batch_high": batch_crossover(f["alpha_high"], c, b, ridge, kind, max_k),
            }
        rows.append(
            {
                **{key: f[key] for key in FIT_KEYS},
                "machine": spec.name,
                "alpha": f["alpha"],
                "cost_ratio": c,
                "cost_source": source,
                "verify_slope": b,
                "best_k": k,
                "predicted": s,
                "predicted_low": predicted_speedup(f["alpha_low"], k, c, b) if k else math.nan,
                "predicted_high": predicted_speedup(f["alpha_high"], k, c, b) if k else math.nan,
                "here_best_k": f["best_k"],
                "here_predicted": f["predicted_best"],
                **crossover,
            }
        )
    return pd.DataFrame(rows)
