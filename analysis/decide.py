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

import numpy as np
import pandas as pd

from analysis.frames import CELL_CONFIDENCE, verify_width
from analysis.names import CONDITION_KEYS, CONTEXT_KEYS, describe, varying
from analysis.paired import MIN_COVERAGE, build_table, category_sums, interval, resample_counts, speedups
from analysis.ship import choose, select, verdict, what_would_change
from harness.errors import HarnessError


def check_weights(weights: dict | None, measured: list[str] | None = None) -> dict[str, float]:
    """The weights as {category: float}; a HarnessError when one is negative or, given the categories
    measured anywhere in the results, when none falls on them (a typo, not another context's mix)."""
    weights = {str(g): float(w) for g, w in (weights or {}).items()}
    if any(w < 0 for w in weights.values()):
        raise HarnessError(f"traffic weights must be >= 0: {weights}")
    if measured is not None and weights and sum(w for g, w in weights.items() if g in measured) <= 0:
        raise HarnessError(
            f"no traffic weight falls on a measured category: weights name {sorted(weights)}, the results have {sorted(measured)}"
        )
    return weights


def resolve_weights(
    weights: dict | None, present: list[str], unpaired: set[str] | frozenset = frozenset()
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
        return (
            equal,
            [
                f"the traffic weights name {', '.join(sorted(weights))}, none of which is measured here: "
                f"every category ({', '.join(present)}) weighs the same"
            ],
            {},
        )
    shares = {g: w / sum(weights.values()) for g, w in missing.items()}
    for why, names in (
        ("not run by every candidate, so not in the paired comparison", [g for g in missing if g in unpaired]),
        ("no measurements", [g for g in missing if g not in unpaired]),
    ):
        if names:
            notes.append(
                f"{why}: {', '.join(sorted(names))} ({100 * sum(shares[g] for g in names):.0f}% of the traffic "
                f"weight); the mix is renormalised over the compared categories"
            )
    if unweighted:
        notes.append(f"not in the mix (no weight): {', '.join(unweighted)}")
    return {g: weights.get(g, 0.0) / covered for g in present}, notes, shares


def decide(
    cells: pd.DataFrame,
    prompts: pd.DataFrame,
    fits: pd.DataFrame | None = None,
    weights: dict | None = None,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> list[dict]:
    """One decision per context (target, sampling, setup); see the module docstring."""
    if weights and not prompts.empty:
        check_weights(weights, sorted(prompts["category"].astype(str).unique()))
    decisions = []
    shown = varying(cells, CONDITION_KEYS)  # the run conditions that tell contexts apart
    for key, group in cells.groupby(CONTEXT_KEYS, sort=True):
        first = group.iloc[0]
        context = {
            **dict(zip(CONTEXT_KEYS, key)),
            **{c: first[c] for c in CONDITION_KEYS},
            "context": " · ".join([first["target"], first["sampling"]] + ([describe(first, shown)] if shown else [])),
        }
        usable = group[group["has_prompts"]]
        if usable.empty:  # W&B runs without their results artifact
            decisions.append(decide_from_summaries(context, group, confidence))
            continue
        excluded = len(group) - len(usable)
        decisions.append(
            decide_context(
                context,
                usable,
                prompts[prompts["cell"].isin(usable["cell"])],
                fits,
                weights,
                confidence,
                n_resamples,
                seed,
                [f"{excluded} cells without per-prompt rows are not in this decision"] if excluded else [],
            )
        )
    return decisions


def decide_from_summaries(context: dict, cells: pd.DataFrame, confidence: float) -> dict:
    """The fallback without per-prompt rows: each cell's own speedup and interval over all its
    prompts (the dataset's own mix, no traffic weights), no paired comparison, same ship rule.
    The intervals are the cells' own, at the harness's CELL_CONFIDENCE whatever `confidence` asks.
    Speedups on different prompt sets do not compare: the candidates are the cells of the dataset
    the most drafts ran, on the prompt set (`prompt_ids`) the most candidates have a cell on (ties: the
    larger), one cell per draft and k: its cell on that set. A candidate whose largest cell ran fewer
    than half the prompts of the median candidate's is left out first (the median, not the lower one:
    unpaired, a cell on fewer prompts is no comparison)."""
    notes = ["no per-prompt rows: each candidate's speedup and interval are its cell's own, over all its prompts"]
    per_dataset = cells.groupby("dataset")["label"].nunique()
    dataset = max(
        sorted(per_dataset.index), key=lambda d: (per_dataset[d], cells.loc[cells["dataset"] == d, "num_prompts"].sum())
    )
    if len(per_dataset) > 1:
        others = cells[cells["dataset"] != dataset]
        named = [f"{r.label} k={r.k} ({r.dataset})" for r in others.itertuples()]
        notes.append(
            f"decided on {dataset}; left out, run on other prompt sets: "
            + ", ".join(named[:8])
            + (f" and {len(named) - 8} more" if len(named) > 8 else "")
        )
    cells = cells[cells["dataset"] == dataset]
    # Unpaired speedups compare only over the same prompts: a quick cell on an easy few would win.
    largest = cells.groupby(["label", "k"], sort=True)["num_prompts"].max()  # a candidate's prompts: its largest cell's
    short = largest[largest < MIN_COVERAGE * float(np.median(largest))]
    if len(short):
        notes.append(
            "left out, fewer than half the prompts of the median candidate: "
            + ", ".join(f"{label} k={k} ({int(n)} prompts)" for (label, k), n in short.items())
        )
        cells = cells[~pd.MultiIndex.from_frame(cells[["label", "k"]]).isin(short.index)]
    # The prompt set the most candidates have a cell on (ties: the larger one).
    counts = cells.drop_duplicates(["prompt_set", "label", "k"])["prompt_set"].value_counts()
    sizes = cells.groupby("prompt_set")["num_prompts"].max()
    kept = max(counts.index, key=lambda p: (counts[p], sizes[p], p))
    usable = cells["prompt_set"] == kept
    other = cells[~usable].drop_duplicates(["label", "k"])
    other = other[
        ~pd.MultiIndex.from_frame(other[["label", "k"]]).isin(pd.MultiIndex.from_frame(cells.loc[usable, ["label", "k"]]))
    ]
    if not other.empty:
        notes.append(
            f"left out, run on other prompts of {dataset}: " + ", ".join(f"{r.label} k={r.k}" for r in other.itertuples())
        )
    cells = cells[usable].drop_duplicates(["label", "k"])  # one cell per candidate: its cell on the compared prompt set
    candidates = [
        {
            "label": r.label,
            "k": int(r.k),
            "draft_kind": r.draft_kind,
            "speedup": float(r.speedup),
            "low": float(r.speedup_ci_low),
            "high": float(r.speedup_ci_high),
            "categories": {},
        }
        for r in cells.sort_values("speedup", ascending=False).itertuples()
    ]
    choice, _, _ = select(candidates, [(c["speedup"], c["low"], c["high"]) for c in candidates])
    choice["verdict"] = verdict(choice, CELL_CONFIDENCE) + " (From cell summaries: unweighted, unpaired, no test.)"
    choice["what_would_change"] = []
    if confidence != CELL_CONFIDENCE:
        notes.append(
            f"the intervals are the cells' own {100 * CELL_CONFIDENCE:g}% intervals (the harness's), "
            f"not {100 * confidence:g}%: recomputing them needs the per-prompt rows"
        )
    return {
        **context,
        "prompts": int(cells["num_prompts"].max()),
        "categories": {},
        "weights": {},
        "confidence": CELL_CONFIDENCE,
        "n_resamples": 0,
        "candidates": candidates,
        "mix": choice,
        "per_category": {},
        "notes": notes,
    }


def decide_context(
    context: dict,
    cells: pd.DataFrame,
    prompts: pd.DataFrame,
    fits: pd.DataFrame | None,
    weights: dict | None,
    confidence: float,
    n_resamples: int,
    seed: int,
    notes: list[str],
) -> dict:
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
        notes = notes + [
            f"fewer than 2 prompts in {', '.join(small)}: no bootstrap interval there"
            + (" nor for the mix" if any(w[g] > 0 for g in small) else "")
            + " (the decision needs at least 2, better 10+, prompts per category)"
        ]
    mix_known = not any(w[g] > 0 for g in small)

    candidates = []
    for i, (label, k) in enumerate(table.candidates):
        lo, hi = interval(mix[i, 1:], confidence) if mix_known else (math.nan, math.nan)
        entry = {
            "label": label,
            "k": k,
            "draft_kind": table.kinds[i],
            "speedup": float(mix[i, 0]),
            "low": lo,
            "high": hi,
            "categories": {},
        }
        for j, g in enumerate(names):
            glo, ghi = interval(per_cat[i, 1:, j], confidence) if g not in small else (math.nan, math.nan)
            entry["categories"][g] = {"speedup": float(per_cat[i, 0, j]), "low": glo, "high": ghi}
        candidates.append(entry)

    in_mix = np.isin(cats, [g for g in names if w[g] > 0])
    mix_choice = choose(candidates, mix, per_prompt, in_mix, lambda c: (c["speedup"], c["low"], c["high"]), confidence)
    per_category = {}
    for j, g in enumerate(names):

        def stat(c, g=g):
            m = c["categories"][g]
            return m["speedup"], m["low"], m["high"]

        per_category[g] = choose(candidates, per_cat[:, :, j], per_prompt, cats == g, stat, confidence)
        per_category[g]["prompts"] = int((cats == g).sum())

    if left_out:  # the verdict is for a mix without these: say so where it is read
        mix_choice["verdict"] += (
            f" Decided without {', '.join(sorted(left_out))} ({100 * sum(left_out.values()):.0f}% of "
            f"the traffic weight): see the notes."
        )
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
    decision["draft_length"] = draft_length_choices(candidates, mix, per_cat, names, confidence, mix_known, small)
    decision["trees"] = tree_choices(candidates, mix, per_cat, names, confidence, mix_known, small)
    return decision


SHIP = {  # what to ship when a family's best beats (yes), loses to (no) or ties (tie) the draft's best plain candidate
    "policy": {
        "yes": "draft_length={suffix}, k cap {k}",
        "no": "constant k={base_k}",
        "tie": "constant k={base_k} (as good: draft_length={suffix} not clearly better)",
    },
    "tree": {
        "yes": "{suffix}, k {k}",
        "no": "chain k={base_k}",
        "tie": "chain k={base_k} (as good: {suffix} not clearly better)",
    },
}


def draft_length_choices(candidates, mix, per_cat, names, confidence, mix_known, small) -> list[dict]:
    """Per draft measured under a draft-length policy (label `draft~policy`, harness.core.lengths) and with
    constant k: its best policy candidate against its best constant-k one (`against_base`)."""
    return against_base(candidates, mix, per_cat, names, confidence, mix_known, small, "policy")


def tree_choices(candidates, mix, per_cat, names, confidence, mix_known, small) -> list[dict]:
    """Per draft measured with token trees (label `draft~tree3x2x1`, `draft~treedyn8`) and as a chain: its best
    tree against its best chain (`width` None), then at each verify width (positions a pass scores, `verify_width`)
    that a chain and a tree share, the best tree of that width against that chain (`against_base`)."""
    best = against_base(candidates, mix, per_cat, names, confidence, mix_known, small, "tree")
    widths = [verify_width(c["label"], c["k"]) for c in candidates]
    equal = []
    for width in sorted(set(widths)):
        same = [w == width for w in widths]
        entries = against_base(candidates, mix, per_cat, names, confidence, mix_known, small, "tree", same)
        equal += [{**e, "width": width} for e in entries]
    return [{**e, "width": None} for e in best] + equal


def against_base(
    candidates: list[dict],
    mix: np.ndarray,
    per_cat: np.ndarray,
    names: list[str],
    confidence: float,
    mix_known: bool,
    small: list,
    family: str,
    among: list[bool] | None = None,
) -> list[dict]:
    """Per draft, its best candidate of a `family` (labels `draft~suffix`: "tree" suffixes start with tree,
    "policy" the others) against its best plain one (no suffix), for the mix and per category: a paired ratio of
    speedups with its bootstrap interval (the same resamples for both), and what to ship (`SHIP`). `among`: per
    candidate, whether it takes part (default: all)."""
    by_draft: dict[str, list[tuple[int, str]]] = {}
    for i, c in enumerate(candidates):
        if among is not None and not among[i]:
            continue
        draft, _, suffix = c["label"].partition("~")
        by_draft.setdefault(draft, []).append((i, suffix))
    out = []
    for draft, entries in sorted(by_draft.items()):
        plain = [i for i, suffix in entries if not suffix]
        others = [i for i, suffix in entries if suffix and suffix.startswith("tree") == (family == "tree")]
        if not plain or not others:
            continue
        scopes = [("mix", mix, mix_known)] + [(g, per_cat[:, :, j], g not in small) for j, g in enumerate(names)]
        for scope, values, known in scopes:
            best, base = (max(idx, key=lambda i: values[i, 0]) for idx in (others, plain))
            ratio = values[best, 0] / values[base, 0]
            low, high = interval(values[best, 1:] / values[base, 1:], confidence) if known else (math.nan, math.nan)
            p, c = candidates[best], candidates[base]
            suffix = p["label"].partition("~")[2]
            verdict = "yes" if low > 1 else "no" if high < 1 else "tie"
            out.append(
                {
                    "draft": draft,
                    "scope": scope,
                    family: suffix,
                    f"{family}_k": p["k"],
                    "constant_k" if family == "policy" else "chain_k": c["k"],
                    "ratio": float(ratio),
                    "low": low,
                    "high": high,
                    "ship": SHIP[family][verdict].format(suffix=suffix, k=p["k"], base_k=c["k"]),
                }
            )
    return out


def decisions_frame(decisions: list[dict]) -> pd.DataFrame:
    """One row per context x (mix | category): what to ship, for the CSV and the markdown."""
    rows = []
    for d in decisions:
        for scope, choice in [("mix", d["mix"]), *d["per_category"].items()]:
            b, r, c = choice["best"], choice["runner_up"] or {}, choice["comparison"] or {}
            rows.append(
                {
                    **{k: d[k] for k in CONTEXT_KEYS},
                    "scope": scope,
                    "ship": choice["ship"],
                    "k": choice["k"],
                    "best": b["label"],
                    "best_k": b["k"],
                    "speedup": b["speedup"],
                    "low": b["low"],
                    "high": b["high"],
                    "runner_up": r.get("label"),
                    "runner_up_k": r.get("k"),
                    "runner_up_speedup": r.get("speedup"),
                    "ratio": c.get("ratio"),
                    "ratio_low": c.get("low"),
                    "ratio_high": c.get("high"),
                    "wilcoxon_p": c.get("wilcoxon_p"),
                }
            )
    return pd.DataFrame(rows)
