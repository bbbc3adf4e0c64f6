"""The decision: which draft and k to ship, per category and for a traffic mix.

A *candidate* is a draft at one k (one or more cells: per dataset, and on one
dataset a rerun or another slice, combined prompt by prompt). A *context* is
what a deployment fixes: the target, the sampling setting (at temperature 0,
greedy, top_k and top_p are ignored: every greedy cell is T=0) and the run
setup (device, dtype, max_new_tokens, cache, compile: a speedup on one GPU
says little about another). Within a context every candidate is measured on
the same prompts, so all comparisons are paired by prompt (dataset, id);
prompts that some candidate lacks are dropped and counted. A candidate that
ran fewer than half the prompts of the typical (lower median) one on each
dataset it ran, i.e. more than half the candidates ran more than twice its
prompts (a quick exploratory cell), is left out and listed, so that it does
not shrink every comparison to its few prompts; a single longer cell is never
the yardstick (of two candidates, neither is left out); one that ran all of
one dataset but not another is kept, and the comparison pairs on what all ran.

Speedup of a candidate on a set of prompts is a throughput ratio, its spec
tokens per second over its own baseline's (each cell times its own baseline
back to back, so drift cancels within a cell):

    S_g = (sum spec tokens / sum spec time) / (sum base tokens / sum base time)   over category g

For a traffic mix where category g is a share w_g of the generated tokens,
serving N tokens takes N sum_g w_g tau_g, tau_g the seconds per token in g,
so the mix speedup is the ratio of those times:

    S_mix = sum_g w_g tau_base_g / sum_g w_g tau_spec_g
          = 1 / sum_g u_g / S_g,   u_g = w_g tau_base_g / sum_h w_h tau_base_h

a weighted harmonic mean of the per-category speedups, weighted by each
category's share of the baseline's time. (A weighted arithmetic mean of S_g
would overstate it: time, not rate, adds up.)

Intervals: a stratified, paired bootstrap over prompts. Each replicate
resamples the prompts of every category with replacement (keeping the
category sizes) and applies the same resample to every candidate, so the
ratio of two candidates' speedups has its own interval. Percentile
intervals, `n_resamples` replicates. (Hand-rolled on resample counts rather
than scipy.stats.bootstrap, which neither stratifies nor shares replicates
between statistics.)

The test between the best two drafts: Wilcoxon signed-rank on per-prompt
log speedup differences (scipy.stats.wilcoxon), over the prompts of the
mix's categories; it is unweighted, the bootstrap interval of the ratio is
the weighted statement.

The ship rule: candidates are ranked by point estimate and the best one
whose interval's lower bound is above 1 ships; when that is not the top
point estimate the verdict names the higher, uncertain one. When no
candidate's lower bound is above 1 the decision is "ship no speculation".
Picking the best of many candidates favours a lucky one (winner's curse):
the interval of the winner is slightly optimistic, more so with many
candidates and few prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from analysis.load import CELL_CONFIDENCE, CONDITION_KEYS, describe, varying
from harness.errors import HarnessError

CONTEXT_KEYS = ["target", "sampling", "setup"]
NO_SPECULATION = "no speculation"
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


def check_weights(weights: dict | None, measured: list[str] | None = None) -> dict[str, float]:
    """The weights as {category: float}; a HarnessError when one is negative or, given the categories
    measured anywhere in the results, when none falls on them (a typo, not another context's mix)."""
    weights = {str(g): float(w) for g, w in (weights or {}).items()}
    if any(w < 0 for w in weights.values()):
        raise HarnessError(f"traffic weights must be >= 0: {weights}")
    if measured is not None and weights and sum(w for g, w in weights.items() if g in measured) <= 0:
        raise HarnessError(f"no traffic weight falls on a measured category: weights name {sorted(weights)}, "
                           f"the results have {sorted(measured)}")
    return weights


def resolve_weights(weights: dict | None, present: list[str], unpaired: set[str] | frozenset = frozenset()
                    ) -> tuple[dict[str, float], list[str], dict[str, float]]:
    """Normalised weights over the categories present, notes on what was dropped, and the dropped weighted
    categories with their share of the weight. `unpaired`: categories some candidates ran but not all (not
    in the comparison). Weights that fall on none of the present ones (another context's) give equal weights."""
    equal = {g: 1 / len(present) for g in present}
    if not weights:
        return equal, ["no traffic weights given: every category weighs the same"], {}
    weights = check_weights(weights)
    notes = []
    missing = {g: w for g, w in weights.items() if g not in present and w > 0}
    unweighted = [g for g in present if g not in weights]
    covered = sum(w for g, w in weights.items() if g in present)
    if covered <= 0:
        return equal, [f"the traffic weights name {', '.join(sorted(weights))}, none of which is measured here: "
                       f"every category ({', '.join(present)}) weighs the same"], {}
    shares = {g: w / sum(weights.values()) for g, w in missing.items()}
    for why, names in (("not run by every candidate, so not in the paired comparison", [g for g in missing if g in unpaired]),
                       ("no measurements", [g for g in missing if g not in unpaired])):
        if names:
            notes.append(f"{why}: {', '.join(sorted(names))} ({100 * sum(shares[g] for g in names):.0f}% of the traffic "
                         f"weight); the mix is renormalised over the compared categories")
    if unweighted:
        notes.append(f"not in the mix (no weight): {', '.join(unweighted)}")
    return {g: weights.get(g, 0.0) / covered for g in present}, notes, shares


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
    rows = (prompts.assign(_rank=prompts["cell"].map(rank)).sort_values("_rank", kind="stable")
            .drop_duplicates(["label", "k", "prompt_key"]).drop(columns="_rank"))
    for (label, k, dataset), group in cells.groupby(["label", "k", "dataset"], sort=True):
        if len(group) > 1:
            n = int(((rows["label"] == label) & (rows["k"] == k) & (rows["dataset"] == dataset)).sum())
            notes.append(f"{label} k={k} on {dataset}: {len(group)} cells, combined prompt by prompt ({n} prompts; "
                         f"one run in several is taken from the cell with the most prompts)")
    candidates = sorted({(r.label, int(r.k)) for r in cells.itertuples()})
    per_candidate = {c: rows[(rows["label"] == c[0]) & (rows["k"] == c[1])].set_index("prompt_key") for c in candidates}
    measured = set().union(*(set(df["category"].astype(str)) for df in per_candidate.values()))  # by any candidate
    # Coverage is judged per dataset: a draft that ran all of one dataset and none of another is a
    # full run to pair on, not a quick exploratory cell.
    coverage = {c: df.groupby("dataset").size().to_dict() for c, df in per_candidate.items()}  # {dataset: prompts}
    typical = {d: _typical([n[d] for n in coverage.values() if d in n]) for d in set().union(*coverage.values())}
    short = [c for c in candidates if typical and all(n < MIN_COVERAGE * typical[d] for d, n in coverage[c].items())]
    if short:
        notes.append("left out, fewer than half the prompts of the (lower) median candidate on each dataset they ran: "
                     + ", ".join(f"{label} k={k} ({sum(coverage[(label, k)].values())} prompts)" for label, k in short))
        candidates = [c for c in candidates if c not in short]
        per_candidate = {c: per_candidate[c] for c in candidates}
    total = sum(w for w in (weights or {}).values() if w > 0)
    share = {g: w / total for g, w in (weights or {}).items() if w > 0 and g in measured}
    ran = {c: set(df["category"].astype(str)) for c, df in per_candidate.items()}
    lacking = {c: sorted(set(share) - ran[c]) for c in candidates}
    lacking = {c: gs for c, gs in lacking.items() if sum(share[g] for g in gs) >= KEEP_CATEGORY_SHARE}
    if lacking and len(lacking) < len(candidates):  # else no candidate ran them all: the pairing note says what goes
        notes.append(f"left out, no prompts in weighted categories other candidates ran ({100 * KEEP_CATEGORY_SHARE:.0f}% of "
                     "the traffic weight or more): " + ", ".join(
                         f"{label} k={k} (no {', '.join(gs)}: {100 * sum(share[g] for g in gs):.0f}%)" for (label, k), gs in lacking.items()))
        candidates = [c for c in candidates if c not in lacking]
        per_candidate = {c: per_candidate[c] for c in candidates}
    union = set().union(*(set(df.index) for df in per_candidate.values()))
    common = sorted(set.intersection(*(set(df.index) for df in per_candidate.values())))
    if not common:  # no prompt all ran: keep the most candidates that share prompts
        keys, kept = _most_shared(per_candidate)
        dropped = [f"{label} k={k}" for label, k in candidates if (label, k) not in kept]
        notes.append(f"no prompt was run by every candidate: compared the {len(kept)} that share the most prompts "
                     f"({len(keys)}); left out: {', '.join(dropped)}")
        candidates, common = kept, sorted(keys)
        per_candidate = {c: per_candidate[c] for c in kept}
    elif len(common) < len(union):
        notes.append(f"{len(union) - len(common)} of {len(union)} prompts are missing from some candidate: paired on the {len(common)} all ran")
    first = per_candidate[candidates[0]].loc[common]

    def stack(column: str) -> np.ndarray:
        return np.stack([per_candidate[c].loc[common, column].to_numpy(dtype=float) for c in candidates])

    kinds = [cells[(cells["label"] == c[0])]["draft_kind"].iloc[0] for c in candidates]
    table = Table(candidates, kinds, common, first["category"].astype(str).tolist(), stack("spec_new_tokens"),
                  stack("spec_time_s"), stack("base_new_tokens"), stack("base_time_s"))
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
    for c, df in per_candidate.items():
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


def _interval(replicates: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    finite = replicates[np.isfinite(replicates)]
    if finite.size < 2:
        return math.nan, math.nan
    return float(np.percentile(finite, tail)), float(np.percentile(finite, 100 - tail))


def decide(cells: pd.DataFrame, prompts: pd.DataFrame, fits: pd.DataFrame | None = None, weights: dict | None = None,
           confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> list[dict]:
    """One decision per context (target, sampling, setup); see the module docstring."""
    if weights and not prompts.empty:
        check_weights(weights, sorted(prompts["category"].astype(str).unique()))
    decisions = []
    shown = varying(cells, CONDITION_KEYS)  # the run conditions that tell contexts apart
    for key, group in cells.groupby(CONTEXT_KEYS, sort=True):
        first = group.iloc[0]
        context = {**dict(zip(CONTEXT_KEYS, key)), **{c: first[c] for c in CONDITION_KEYS},
                   "context": " · ".join([first["target"], first["sampling"]] + ([describe(first, shown)] if shown else []))}
        usable = group[group["has_prompts"]]
        if usable.empty:  # W&B runs without their results artifact
            decisions.append(decide_from_summaries(context, group, confidence))
            continue
        excluded = len(group) - len(usable)
        decisions.append(decide_context(context, usable, prompts[prompts["cell"].isin(usable["cell"])], fits,
                                        weights, confidence, n_resamples, seed,
                                        [f"{excluded} cells without per-prompt rows are not in this decision"] if excluded else []))
    return decisions


def decide_from_summaries(context: dict, cells: pd.DataFrame, confidence: float) -> dict:
    """The fallback without per-prompt rows: each cell's own speedup and interval over all its
    prompts (the dataset's own mix, no traffic weights), no paired comparison, same ship rule.
    The intervals are the cells' own, at the harness's CELL_CONFIDENCE whatever `confidence` asks.
    Speedups on different prompt sets do not compare: the candidates are the cells of the dataset
    the most drafts ran, on the prompt set (`prompt_ids`) the most candidates have a cell on (ties: the
    larger), one cell per draft and k: its cell on that set (where no summary records its prompts, its
    largest). A candidate whose largest cell ran fewer than half the prompts of the median candidate's
    is left out first (the median, not the lower one: unpaired, a cell on fewer prompts is no comparison)."""
    notes = ["no per-prompt rows: each candidate's speedup and interval are its cell's own, over all its prompts"]
    per_dataset = cells.groupby("dataset")["label"].nunique()
    dataset = max(sorted(per_dataset.index), key=lambda d: (per_dataset[d], cells.loc[cells["dataset"] == d, "num_prompts"].sum()))
    if len(per_dataset) > 1:
        others = cells[cells["dataset"] != dataset]
        named = [f"{r.label} k={r.k} ({r.dataset})" for r in others.itertuples()]
        notes.append(f"decided on {dataset}; left out, run on other prompt sets: " + ", ".join(named[:8])
                     + (f" and {len(named) - 8} more" if len(named) > 8 else ""))
    cells = cells[cells["dataset"] == dataset]
    # Unpaired speedups compare only over the same prompts: a quick cell on an easy few would win.
    largest = cells.groupby(["label", "k"], sort=True)["num_prompts"].max()  # a candidate's prompts: its largest cell's
    typical = float(np.nanmedian(largest)) if largest.notna().any() else math.nan
    short = largest[largest < MIN_COVERAGE * typical]  # none where either is unknown
    if len(short):
        notes.append("left out, fewer than half the prompts of the median candidate: "
                     + ", ".join(f"{label} k={k} ({int(n)} prompts)" for (label, k), n in short.items()))
        cells = cells[~pd.MultiIndex.from_frame(cells[["label", "k"]]).isin(short.index)]
    if "prompt_set" not in cells:
        cells = cells.assign(prompt_set=None)
    sets = cells["prompt_set"]
    known = cells[sets.notna()]
    kept = None
    if known["prompt_set"].nunique() > 1:  # the prompt set the most candidates have a cell on (ties: the larger one)
        counts = known.drop_duplicates(["prompt_set", "label", "k"])["prompt_set"].value_counts()
        sizes = known.groupby("prompt_set")["num_prompts"].max()
        kept = max(counts.index, key=lambda p: (counts[p], sizes[p], p))
    elif not known.empty:
        kept = known["prompt_set"].iloc[0]
    on_kept = sets == kept if kept is not None else pd.Series(False, index=cells.index)
    usable = sets.isna() | on_kept
    other = cells[~usable].drop_duplicates(["label", "k"])
    other = other[~pd.MultiIndex.from_frame(other[["label", "k"]]).isin(pd.MultiIndex.from_frame(cells.loc[usable, ["label", "k"]]))]
    if not other.empty:
        notes.append(f"left out, run on other prompts of {dataset}: " + ", ".join(f"{r.label} k={r.k}" for r in other.itertuples()))
    # One cell per candidate: its cell on the compared prompt set, else (prompts not recorded) its largest.
    cells = (cells[usable].assign(_on=on_kept[usable])
             .sort_values(["_on", "num_prompts"], ascending=False, na_position="last", kind="stable")
             .drop_duplicates(["label", "k"]).drop(columns="_on"))
    candidates = [{"label": r.label, "k": int(r.k), "draft_kind": r.draft_kind, "speedup": float(r.speedup),
                   "low": float(r.speedup_ci_low), "high": float(r.speedup_ci_high), "categories": {}}
                  for r in cells.sort_values("speedup", ascending=False).itertuples()]
    choice, _, _ = _select(candidates, [(c["speedup"], c["low"], c["high"]) for c in candidates])
    choice["verdict"] = _verdict(choice, CELL_CONFIDENCE) + " (From cell summaries: unweighted, unpaired, no test.)"
    choice["what_would_change"] = []
    if confidence != CELL_CONFIDENCE:
        notes.append(f"the intervals are the cells' own {100 * CELL_CONFIDENCE:g}% intervals (the harness's), "
                     f"not {100 * confidence:g}%: recomputing them needs the per-prompt rows")
    prompts = cells["num_prompts"].max()
    return {**context, "prompts": int(prompts) if prompts == prompts else 0, "categories": {}, "weights": {},
            "confidence": CELL_CONFIDENCE, "n_resamples": 0, "candidates": candidates, "mix": choice, "per_category": {},
            "notes": notes}


def decide_context(context: dict, cells: pd.DataFrame, prompts: pd.DataFrame, fits: pd.DataFrame | None,
                   weights: dict | None, confidence: float, n_resamples: int, seed: int, notes: list[str]) -> dict:
    table, table_notes, unpaired = build_table(cells, prompts, weights)
    names = sorted(set(table.categories))
    w, weight_notes, left_out = resolve_weights(weights, names, unpaired)
    w_vec = np.array([w[g] for g in names])
    counts = resample_counts(table.categories, n_resamples, seed)
    per_cat, mix = speedups(category_sums(table, counts, names), w_vec)
    per_prompt = (table.spec_tokens / table.spec_time) / (table.base_tokens / table.base_time)  # [c, p]
    cats = np.asarray(table.categories)

    # A category of one prompt has no spread to resample: its interval (and the mix's) is unknown.
    small = [g for g in names if (cats == g).sum() < 2]
    if small:
        notes = notes + [f"fewer than 2 prompts in {', '.join(small)}: no bootstrap interval there"
                         + (" nor for the mix" if any(w[g] > 0 for g in small) else "")
                         + " (the decision needs at least 2, better 10+, prompts per category)"]
    mix_known = not any(w[g] > 0 for g in small)

    candidates = []
    for i, (label, k) in enumerate(table.candidates):
        lo, hi = _interval(mix[i, 1:], confidence) if mix_known else (math.nan, math.nan)
        entry = {"label": label, "k": k, "draft_kind": table.kinds[i], "speedup": float(mix[i, 0]), "low": lo, "high": hi,
                 "categories": {}}
        for j, g in enumerate(names):
            glo, ghi = _interval(per_cat[i, 1:, j], confidence) if g not in small else (math.nan, math.nan)
            entry["categories"][g] = {"speedup": float(per_cat[i, 0, j]), "low": glo, "high": ghi}
        candidates.append(entry)

    in_mix = np.isin(cats, [g for g in names if w[g] > 0])
    mix_choice = _choose(candidates, mix, per_prompt, in_mix, lambda c: (c["speedup"], c["low"], c["high"]), confidence)
    per_category = {}
    for j, g in enumerate(names):
        def stat(c, g=g):
            m = c["categories"][g]
            return m["speedup"], m["low"], m["high"]
        per_category[g] = _choose(candidates, per_cat[:, :, j], per_prompt, cats == g, stat, confidence)
        per_category[g]["prompts"] = int((cats == g).sum())

    if left_out:  # the verdict is for a mix without these: say so where it is read
        mix_choice["verdict"] += (f" Decided without {', '.join(sorted(left_out))} ({100 * sum(left_out.values()):.0f}% of "
                                  f"the traffic weight): see the notes.")
    decision = {
        **context,
        "prompts": len(table.prompt_keys),
        "categories": {g: int((cats == g).sum()) for g in names},
        "weights": w,
        "confidence": confidence,
        "n_resamples": n_resamples,
        "candidates": sorted(candidates, key=lambda c: -c["speedup"]),
        "mix": mix_choice,
        "per_category": per_category,
        "notes": notes + table_notes + weight_notes,
    }
    decision["mix"]["what_would_change"] = what_would_change(decision, table, names, w_vec, fits, cells)
    return decision


def _select(candidates: list[dict], stats: list[tuple[float, float, float]]) -> tuple[dict, int, int | None]:
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
    choice = {"best": brief(best), "top": brief(order[0]) if order[0] != best else None,
              "runner_up": brief(other) if other is not None else None, "comparison": None,
              "ship": candidates[best]["label"] if ships else NO_SPECULATION, "k": candidates[best]["k"] if ships else None}
    return choice, best, other


def _choose(candidates: list[dict], replicates: np.ndarray, per_prompt: np.ndarray, prompts_used: np.ndarray,
            stat, confidence: float) -> dict:
    """The candidate the ship rule picks (_select), the best of another draft, their comparison, the verdict."""
    choice, best, other = _select(candidates, [stat(c) for c in candidates])
    if other is not None:
        ratio = replicates[best] / replicates[other]  # [1 + n_resamples]
        rlo, rhi = _interval(ratio[1:], confidence) if np.isfinite(choice["best"]["low"]) else (math.nan, math.nan)
        diffs = np.log(per_prompt[best, prompts_used]) - np.log(per_prompt[other, prompts_used])
        choice["comparison"] = {"ratio": float(ratio[0]), "low": rlo, "high": rhi,
                                "p_bootstrap_not_better": float(np.mean(ratio[1:] <= 1)),
                                "wilcoxon_p": wilcoxon_p(diffs), "prompts": int(prompts_used.sum()),
                                "significant": bool(rlo > 1)}
    choice["verdict"] = _verdict(choice, confidence)
    return choice


def _brief(c: dict, s: float, lo: float, hi: float) -> dict:
    return {"label": c["label"], "k": c["k"], "speedup": s, "low": lo, "high": hi}


def wilcoxon_p(diffs: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of paired differences (NaN when it cannot be computed)."""
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size < 2 or np.all(diffs == 0):
        return math.nan
    return float(stats.wilcoxon(diffs).pvalue)


def _f(x: float, fmt: str = ".3f") -> str:
    return "nan" if x is None or x != x else format(x, fmt)


def _verdict(choice: dict, confidence: float) -> str:
    b, pct = choice["best"], f"{100 * confidence:g}%"
    interval = f"{_f(b['speedup'])}×" + (f" [{_f(b['low'])}, {_f(b['high'])}]" if b["low"] == b["low"] else "")
    if choice["ship"] == NO_SPECULATION:
        why = "lower bound ≤ 1" if b["low"] == b["low"] else "no interval: too few prompts"
        return (f"Ship no speculation: no draft beats the baseline with {pct} confidence "
                f"(best: {b['label']} k={b['k']}, speedup {interval}, {why}).")
    text = f"Ship {b['label']} with k={b['k']}: speedup {interval} ({pct} interval)."
    top, cmp, r = choice.get("top"), choice["comparison"], choice["runner_up"]
    if top:
        text += (f" {top['label']} k={top['k']} measures higher ({_f(top['speedup'])}× [{_f(top['low'])}, "
                 f"{_f(top['high'])}]) but is not confidently faster than the baseline (lower bound ≤ 1).")
    if cmp:
        rel = (f"{b['label']} vs {r['label']} (k={r['k']}): ratio {_f(cmp['ratio'])} [{_f(cmp['low'])}, {_f(cmp['high'])}], "
               f"Wilcoxon p = {_f(cmp['wilcoxon_p'], '.3g')} over {cmp['prompts']} prompts")
        if cmp["significant"]:
            text += f" It beats the runner-up: {rel}."
        elif r["low"] > 1:
            text += f" Not distinguishable from the runner-up: {rel}; either is defensible."
        elif top and (top["label"], top["k"]) == (r["label"], r["k"]):
            text += f" Compared with it: {rel}."
        else:
            text += (f" Not distinguishable from the runner-up: {rel}; but {r['label']} k={r['k']} is not "
                     f"confidently faster than the baseline (lower bound ≤ 1).")
    return text


def what_would_change(decision: dict, table: Table, names: list[str], w: np.ndarray, fits: pd.DataFrame | None,
                      cells: pd.DataFrame) -> list[str]:
    """Plain sentences: how far each input is from flipping the mix decision."""
    mix, out = decision["mix"], []
    best, runner, cmp = mix["best"], mix["runner_up"], mix["comparison"]
    n = decision["prompts"]
    # Sampling noise: prompts needed to resolve the top two (interval half-width scales as 1/sqrt(n)).
    if cmp and not cmp["significant"] and cmp["ratio"] > 0 and all(np.isfinite([cmp["low"], cmp["high"]])):
        half = (math.log(cmp["high"]) - math.log(max(cmp["low"], 1e-12))) / 2
        effect = abs(math.log(cmp["ratio"]))
        if effect > 0:
            out.append(f"More prompts: {best['label']} and {runner['label']} differ by {100 * (cmp['ratio'] - 1):+.1f}%; "
                       f"about {math.ceil(n * (half / effect) ** 2)} prompts (now {n}) would separate a difference that size.")
    if mix["ship"] == NO_SPECULATION and np.isfinite(best["low"]) and best["speedup"] > 0:
        half = (math.log(max(best["high"], 1e-12)) - math.log(max(best["low"], 1e-12))) / 2
        gain = math.log(best["speedup"])
        if gain > 0:
            out.append(f"More prompts: {best['label']} k={best['k']} measures {best['speedup']:.3f}×; about "
                       f"{math.ceil(n * (half / gain) ** 2)} prompts (now {n}) would show whether it beats the baseline.")
    # Traffic mix: the share of one category at which the runner-up overtakes.
    if runner is not None and len(names) > 1:
        i = table.candidates.index((best["label"], best["k"]))
        j = table.candidates.index((runner["label"], runner["k"]))
        counts = np.ones((1, len(table.prompt_keys)))
        sums = category_sums(table, counts, names)
        for g_index, g in enumerate(names):
            flip = _flip_share(sums, i, j, w, g_index)
            if flip is not None:
                out.append(f"Traffic: if {g} rises from {100 * w[g_index]:.0f}% to {100 * flip:.0f}% of the tokens, "
                           f"{runner['label']} k={runner['k']} overtakes {best['label']} (point estimates).")
    # The fitted model: an unmeasured k, or the costs at which the draft stops paying.
    if fits is not None and not fits.empty:
        label = best["label"]
        rows = fits[(fits["label"] == label) & (fits[CONTEXT_KEYS] == [decision[k] for k in CONTEXT_KEYS]).all(axis=1)]
        for _, f in rows.iterrows():
            measured = {int(k) for k in f["ks"].split()}
            if f["best_k"] and f["best_k"] not in measured and f["predicted_best"] > 1:  # one that would lose changes nothing
                out.append(f"Unmeasured k ({f['dataset']}): the fit puts {label}'s best k at {f['best_k']} "
                           f"(predicted {f['predicted_best']:.3f}×, measured k: {f['ks']}); run k={f['best_k']} to confirm.")
            where = f"Costs (fitted model, {f['dataset']}): {label}"
            if f["alpha"] != f["alpha"]:  # NaN: no drafted position was ever tested
                out.append(f"{where}: α is unknown (no drafted token was ever verified, e.g. a prompt lookup that never "
                           f"matched), so the model cannot say what a cheaper draft would give.")
                continue
            if not f["break_even_cost_ratio"] > 0:
                out.append(f"{where}: at α = {_f(f['alpha'])} and the measured verify cost (b = {_f(f['verify_slope'])}) "
                           f"even a free draft (c = 0) predicts no speedup above 1; only a cheaper verify pass would.")
                continue
            at_c = (f"at this c, while α ≥ {_f(f['break_even_alpha'])}" if f["break_even_alpha"] == f["break_even_alpha"]
                    else "at this c no α does")
            out.append(f"{where} pays off (predicted speedup > 1 at some k ≤ {f['max_k']}) while c ≤ "
                       f"{_f(f['break_even_cost_ratio'])} (measured c = {_f(f['cost_ratio'])}) and, {at_c} "
                       f"(measured α = {_f(f['alpha'])}).")
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


def decisions_frame(decisions: list[dict]) -> pd.DataFrame:
    """One row per context x (mix | category): what to ship, for the CSV and the markdown."""
    rows = []
    for d in decisions:
        for scope, choice in [("mix", d["mix"]), *d["per_category"].items()]:
            b, r, c = choice["best"], choice["runner_up"] or {}, choice["comparison"] or {}
            rows.append({**{k: d[k] for k in CONTEXT_KEYS}, "scope": scope, "ship": choice["ship"],
                         "k": choice["k"], "best": b["label"], "best_k": b["k"], "speedup": b["speedup"],
                         "low": b["low"], "high": b["high"], "runner_up": r.get("label"), "runner_up_k": r.get("k"),
                         "runner_up_speedup": r.get("speedup"), "ratio": c.get("ratio"), "ratio_low": c.get("low"),
                         "ratio_high": c.get("high"), "wilcoxon_p": c.get("wilcoxon_p")})
    return pd.DataFrame(rows)

