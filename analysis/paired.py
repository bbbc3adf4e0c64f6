"""The paired comparison of one context: its candidates aligned on the prompts they all ran,
and the stratified bootstrap over those prompts (analysis.decide's docstring has the method).

A *candidate* is a draft at one k (one or more cells, combined prompt by
prompt). Each bootstrap replicate resamples the prompts of every category
with replacement (keeping the category sizes) and applies the same resample
to every candidate, so the ratio of two candidates' speedups has its own
interval. Percentile intervals. (Hand-rolled on resample counts rather than
scipy.stats.bootstrap, which neither stratifies nor shares replicates
between statistics.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

MIN_COVERAGE = 0.5  # a candidate with fewer prompts than this share of the (lower) median candidate's is left out
# A weighted category some candidates did not run, while others did: where those categories carry at least
# this share of the traffic weight, such a candidate is left out (it cannot be judged on the mix); below it,
# the candidates are compared without those categories, and the verdict says so.
KEEP_CATEGORY_SHARE = 0.10


@dataclass
class Table:
    """Aligned per-prompt arrays of one context: [candidates, prompts]."""

    candidates: list[tuple[str, int]]  # (label, k)
    kinds: list[str]
    prompt_keys: list[str]
    categories: list[str]  # [prompts]
    spec_tokens: np.ndarray
    spec_time: np.ndarray
    base_tokens: np.ndarray
    base_time: np.ndarray


def build_table(cells: pd.DataFrame, prompts: pd.DataFrame, weights: dict | None = None) -> tuple[Table, list[str], set[str]]:
    """Align one context's candidates on the prompts they all ran. A candidate's cells (several on one
    dataset: a rerun, a longer or another slice of it) are combined prompt by prompt, one record per
    prompt (each record holds its own speculative and baseline timings, back to back, so records of
    several cells pool as prompts of one do); a prompt run in several cells is taken from the cell with
    the most prompts. Left out: candidates that ran fewer than MIN_COVERAGE of the lower median
    candidate's prompts on every dataset they ran (_typical: more than half the candidates ran more than
    twice theirs; one cell that ran more prompts than the rest, e.g. one of two, never pushes the others
    out); and those that ran no prompt of weighted categories other candidates ran, carrying
    KEEP_CATEGORY_SHARE of the weight or more: pairing would drop them for all. Returns the table,
    notes, and the categories some candidate ran that the comparison leaves out."""
    notes = []
    order = cells.sort_values(["num_prompts", "cell"], ascending=[False, True], na_position="last", kind="stable")
    rank = {cell: i for i, cell in enumerate(order["cell"])}
    rows = (
        prompts.assign(_rank=prompts["cell"].map(rank))
        .sort_values("_rank", kind="stable")
        .drop_duplicates(["label", "k", "prompt_key"])
        .drop(columns="_rank")
    )
    for (label, k, dataset), group in cells.groupby(["label", "k", "dataset"], sort=True):
        if len(group) > 1:
            n = int(((rows["label"] == label) & (rows["k"] == k) & (rows["dataset"] == dataset)).sum())
            notes.append(
                f"{label} k={k} on {dataset}: {len(group)} cells, combined prompt by prompt ({n} prompts; "
                f"one run in several is taken from the cell with the most prompts)"
            )
    candidates = sorted({(r.label, int(r.k)) for r in cells.itertuples()})
    per_candidate = {c: rows[(rows["label"] == c[0]) & (rows["k"] == c[1])].set_index("prompt_key") for c in candidates}
    measured = set().union(*(set(df["category"].astype(str)) for df in per_candidate.values()))  # by any candidate
    # Coverage is judged per dataset: a draft that ran all of one dataset and none of another is a
    # full run to pair on, not a quick exploratory cell.
    coverage = {c: df.groupby("dataset").size().to_dict() for c, df in per_candidate.items()}  # {dataset: prompts}
    typical = {d: _typical([n[d] for n in coverage.values() if d in n]) for d in set().union(*coverage.values())}
    short = [c for c in candidates if typical and all(n < MIN_COVERAGE * typical[d] for d, n in coverage[c].items())]
    if short:
        notes.append(
            "left out, fewer than half the prompts of the (lower) median candidate on each dataset they ran: "
            + ", ".join(f"{label} k={k} ({sum(coverage[(label, k)].values())} prompts)" for label, k in short)
        )
        candidates = [c for c in candidates if c not in short]
        per_candidate = {c: per_candidate[c] for c in candidates}
    total = sum(w for w in (weights or {}).values() if w > 0)
    share = {g: w / total for g, w in (weights or {}).items() if w > 0 and g in measured}
    ran = {c: set(df["category"].astype(str)) for c, df in per_candidate.items()}
    lacking = {c: sorted(set(share) - ran[c]) for c in candidates}
    lacking = {c: gs for c, gs in lacking.items() if sum(share[g] for g in gs) >= KEEP_CATEGORY_SHARE}
    if lacking and len(lacking) < len(candidates):  # else no candidate ran them all: the pairing note says what goes
        notes.append(
            f"left out, no prompts in weighted categories other candidates ran ({100 * KEEP_CATEGORY_SHARE:.0f}% of "
            "the traffic weight or more): "
            + ", ".join(
                f"{label} k={k} (no {', '.join(gs)}: {100 * sum(share[g] for g in gs):.0f}%)"
                for (label, k), gs in lacking.items()
            )
        )
        candidates = [c for c in candidates if c not in lacking]
        per_candidate = {c: per_candidate[c] for c in candidates}
    union = set().union(*(set(df.index) for df in per_candidate.values()))
    common = sorted(set.intersection(*(set(df.index) for df in per_candidate.values())))
    if not common:  # no prompt all ran: keep the most candidates that share prompts
        keys, kept = _most_shared(per_candidate)
        dropped = [f"{label} k={k}" for label, k in candidates if (label, k) not in kept]
        notes.append(
            f"no prompt was run by every candidate: compared the {len(kept)} that share the most prompts "
            f"({len(keys)}); left out: {', '.join(dropped)}"
        )
        candidates, common = kept, sorted(keys)
        per_candidate = {c: per_candidate[c] for c in kept}
    elif len(common) < len(union):
        notes.append(
            f"{len(union) - len(common)} of {len(union)} prompts are missing from some candidate: paired on the {len(common)} all ran"
        )
    first = per_candidate[candidates[0]].loc[common]

    def stack(column: str) -> np.ndarray:
        return np.stack([per_candidate[c].loc[common, column].to_numpy(dtype=float) for c in candidates])

    kinds = [cells[(cells["label"] == c[0])]["draft_kind"].iloc[0] for c in candidates]
    table = Table(
        candidates,
        kinds,
        common,
        first["category"].astype(str).tolist(),
        stack("spec_new_tokens"),
        stack("spec_time_s"),
        stack("base_new_tokens"),
        stack("base_time_s"),
    )
    return table, notes, measured - set(table.categories)


def _typical(counts: list[int]) -> float:
    """The yardstick of coverage: the lower median of the candidates' prompt counts, a count more than
    half of them reached. A count below MIN_COVERAGE of it is one that more than half the candidates ran
    more than twice of; with two candidates it is the smaller one's, so neither pushes the other out."""
    return float(sorted(counts)[(len(counts) - 1) // 2])


def _most_shared(per_candidate: dict) -> tuple[set, list]:
    """(prompts, candidates): the most candidates whose common prompts are not empty, and those prompts
    (ties: more prompts). Tried per dataset, on all the candidates that ran some of it (a draft that
    ran two datasets meets on each the drafts that ran only that one), and per identical prompt set."""
    options = []
    for dataset in sorted(set().union(*(df["dataset"] for df in per_candidate.values()))):
        ran = [c for c, df in per_candidate.items() if (df["dataset"] == dataset).any()]
        shared = set.intersection(*(set(per_candidate[c].index[per_candidate[c]["dataset"] == dataset]) for c in ran))
        options.append((shared, ran))
    for df in per_candidate.values():
        options.append((set(df.index), [d for d, other in per_candidate.items() if set(df.index) <= set(other.index)]))
    return max((o for o in options if o[0]), key=lambda o: (len(o[1]), len(o[0])))


def resample_counts(categories: list[str], n_resamples: int, seed: int) -> np.ndarray:
    """[1 + n_resamples, prompts] how often each prompt is drawn; row 0 is the data itself.
    Stratified: each category's prompts are resampled among themselves."""
    rng = np.random.default_rng(seed)
    cats = np.asarray(categories)
    counts = np.zeros((n_resamples + 1, len(cats)))
    counts[0] = 1
    for g in np.unique(cats):
        idx = np.flatnonzero(cats == g)
        counts[1:, idx] = rng.multinomial(len(idx), np.full(len(idx), 1 / len(idx)), size=n_resamples)
    return counts


def category_sums(table: Table, counts: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """Resampled per-category totals: each [candidates, 1 + n_resamples, categories]."""
    mask = (np.asarray(table.categories)[:, None] == np.asarray(names)[None, :]).astype(float)  # [prompts, categories]
    out = {}
    for name in ("spec_tokens", "spec_time", "base_tokens", "base_time"):
        x = getattr(table, name)  # [candidates, prompts]
        out[name] = np.einsum("bp,cp,pg->cbg", counts, x, mask)
    return out


def speedups(sums: dict[str, np.ndarray], weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per-category S_g [c, b, g], mix S [c, b]) from resampled totals; weights [g] sum to 1."""
    tau_spec = sums["spec_time"] / sums["spec_tokens"]
    tau_base = sums["base_time"] / sums["base_tokens"]
    per_category = tau_base / tau_spec
    used = weights > 0
    mix = (tau_base[..., used] * weights[used]).sum(-1) / (tau_spec[..., used] * weights[used]).sum(-1)
    return per_category, mix


def interval(replicates: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    finite = replicates[np.isfinite(replicates)]
    if finite.size < 2:
        return math.nan, math.nan
    return float(np.percentile(finite, tail)), float(np.percentile(finite, 100 - tail))


def wilcoxon_p(diffs: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of paired differences (NaN when it cannot be computed)."""
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size < 2 or np.all(diffs == 0):
        return math.nan
    return float(stats.wilcoxon(diffs).pvalue)
