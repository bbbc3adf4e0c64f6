"""The check itself: per prompt the joint, first-token and bonus G-tests of the draws against
the exact law, Holm over the family, the sample size a detectable TV needs, and the report."""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np
import torch
from scipy import stats

from harness.core.rule import verify_rows
from harness.core.sampling import Sampling
from harness.errors import HarnessError
from harness.exactness.law import (
    MIN_EXPECTED,
    Draw,
    Partition,
    TargetLaw,
    draw_batches,
    draw_continuations,
    min_expected_for,
)
from harness.exactness.stats import POWER, detectable_tv, g_test, holm, samples_for_tv, tv_estimate

TESTS = ("joint", "first", "bonus")  # per prompt; at batch_size > 1 also "rows" (rows_independence)
FEW_CELLS = 8  # a joint test with fewer cells than this gets a note: the prompt's continuations hardly vary


def goodness_of_fit(
    law: TargetLaw, draws: Sequence[Draw], max_cells: int, seed: int = 0, pairs: Sequence[tuple[int, int]] | None = None
) -> dict:
    """The joint, first-token and bonus G-tests of one prompt's draws against its exact law; with
    `pairs` (draws that ran as two rows of one batch), the rows' independence test too."""
    n = len(draws)
    seqs = [d.tokens for d in draws]
    # Outright failures: continuations the target could never have produced.
    zero = sum(count for seq, count in Counter(seqs).items() if not law.possible(seq))
    min_expected = min_expected_for(n, max_cells)

    joint = Partition.build(law, n, law.length, min_expected=min_expected)
    joint_counts = joint.counts(seqs)
    first = Partition.build(law, n, 1, min_expected=min_expected)
    tests = {
        "joint": _result(*g_test(joint_counts, joint.probs), len(joint.probs), n),
        "first": _result(*g_test(first.counts(seqs), first.probs), len(first.probs), n),
    }
    if zero:
        tests["joint"]["p_value"] = 0.0

    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)  # accepted prefix -> [prefix + bonus]
    for d in draws:
        if d.bonus_prefix is not None:
            groups[d.bonus_prefix].append(d.bonus_prefix + (d.bonus,))
    statistic, df, cells, observed = 0.0, 0, 0, 0
    for prefix in sorted(groups):
        group = groups[prefix]
        part = Partition.build(law, len(group), 1, root=prefix, min_expected=min_expected_for(len(group), max_cells))
        g, dg, _ = g_test(part.counts(group), part.probs)
        if dg > 0:  # a group too small for two cells says nothing
            statistic, df, cells, observed = statistic + g, df + dg, cells + len(part.probs), observed + len(group)
    tests["bonus"] = _result(statistic, df, float(stats.chi2.sf(statistic, df)) if df else 1.0, cells, observed)

    if pairs is not None:
        tests["rows"] = rows_independence(joint, seqs, pairs)

    expected = n * joint.probs
    worst = np.argsort(-np.abs(joint_counts - expected) / np.sqrt(expected))[:5]
    return {
        "samples": n,
        "zero_probability_samples": zero,
        "min_expected": min_expected,
        "tests": tests,
        "tv": tv_estimate(joint_counts, joint.probs, tests["joint"]["statistic"], tests["joint"]["df"], seed),
        "worst_cells": [
            {
                "prefix": list(joint.labels[c][0]),
                "kind": joint.labels[c][1],
                "observed": int(joint_counts[c]),
                "expected": float(expected[c]),
            }
            for c in worst
        ],
    }


def rows_independence(joint: Partition, seqs: Sequence[tuple[int, ...]], pairs: Sequence[tuple[int, int]]) -> dict:
    """Two rows of a batch decoding the same prompt must be independent draws: their continuations
    fall in the same joint cell with probability sum_c pi_c^2. A binomial test for more coincidences
    than that catches rows that share random draws (or one's cache feeding the other)."""
    same = sum(joint.cell(seqs[a]) == joint.cell(seqs[b]) for a, b in pairs)
    chance = float(np.sum(joint.probs**2))
    p_value = float(stats.binom.sf(same - 1, len(pairs), chance)) if pairs and len(joint.probs) > 1 else 1.0
    return {
        **_result(float(same), int(bool(pairs) and len(joint.probs) > 1), p_value, len(joint.probs), len(pairs)),
        "chance": chance,
    }


def _result(statistic: float, df: int, p_value: float, cells: int, observations: int) -> dict:
    return {"statistic": statistic, "df": df, "p_value": p_value, "cells": cells, "observations": observations}


def check(
    target,
    drafter,
    prompts: Sequence[tuple[str, torch.Tensor]],
    *,
    k: int,
    sampling: Sampling,
    length: int,
    samples: int,
    eos_ids: set[int] = frozenset(),
    seed: int = 0,
    alpha: float = 1e-3,
    max_cells: int = 200,
    rule=verify_rows,
    law_target=None,
    progress: bool = False,
    batch: int | None = None,
    rows: int = 1,
) -> dict:
    """Run the exactness check over prompts [(name, ids [T])]; returns the report.

    `law_target` computes the exact law (default: `target`). Tests pass the
    honest model here while `target` is a deliberately broken wrapper of it.
    `batch` = a batch size: the draws come from batches of that many rows of the loop, the prompts
    alternating over the rows (harness.exactness.law.draw_batches), and each prompt adds the rows'
    independence test. Else `rows` > 1: each prompt's draws come from batches of `rows` rows of that
    prompt alone, each row its own random stream (faster than one sequence at a time), and the rows'
    independence test is added too.
    """
    from tqdm import tqdm

    if sampling.greedy:
        raise HarnessError("the exactness check tests a sampling law: set temperature > 0 (e.g. temperature=1.0)")
    if length < 2:
        raise HarnessError(f"exactness.length={length} must be at least 2")
    bar = tqdm(total=samples * len(prompts), desc="speculative samples", unit="sample", file=sys.stderr, disable=not progress)
    per_prompt = {}
    if batch is not None:
        batched = draw_batches(target, drafter, prompts, batch, k, sampling, length, eos_ids, samples, seed, rule, bar)
    for index, (name, ids) in enumerate(prompts):
        law = TargetLaw(law_target if law_target is not None else target, ids, sampling, eos_ids, length)
        if batch is None and rows > 1:
            draws, pairs = draw_batches(
                target, drafter, [(name, ids)], rows, k, sampling, length, eos_ids, samples, (seed, index), rule, bar
            )[name]
            per_prompt[name] = goodness_of_fit(law, draws, max_cells, seed=seed, pairs=pairs)
        elif batch is None:
            draws = draw_continuations(target, drafter, ids, k, sampling, length, eos_ids, samples, (seed, index), rule, bar)
            per_prompt[name] = goodness_of_fit(law, draws, max_cells, seed=seed)
        else:
            draws, pairs = batched[name]
            per_prompt[name] = goodness_of_fit(law, draws, max_cells, seed=seed, pairs=pairs)
    bar.close()

    family = [(name, test) for name in per_prompt for test in per_prompt[name]["tests"]]
    adjusted = holm([per_prompt[name]["tests"][test]["p_value"] for name, test in family])
    level = alpha / len(family)  # Holm's first step: the power below is for this level
    for (name, test), p_holm in zip(family, adjusted):
        result = per_prompt[name]["tests"][test]
        result["p_holm"] = p_holm
        result["detectable_tv"] = None if test == "rows" else detectable_tv(result["observations"], result["df"], level)
    joint_detectable = [r["tests"]["joint"]["detectable_tv"] for r in per_prompt.values()]
    # Whether anything could reject: a test with a degree of freedom, or a sample the target's law rules out.
    testable = any(per_prompt[name]["tests"][test]["df"] > 0 for name, test in family) or any(
        p["zero_probability_samples"] for p in per_prompt.values()
    )
    return {
        "passed": testable and min(adjusted) >= alpha,
        "testable": testable,
        "family_p": min(adjusted),
        "alpha": alpha,
        "tests_in_family": len(family),
        "detectable_tv": max((d for d in joint_detectable if d is not None), default=None),
        "power": POWER,
        "k": k,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "length": length,
        "samples": samples,
        "seed": seed,
        "max_cells": max_cells,
        "prompts": per_prompt,
    }


def one_continuation(law: TargetLaw) -> bool:
    """Does the target's law put all its mass on one continuation (top_k=1, say)? Then no N splits it into cells."""
    prefix: tuple[int, ...] = ()
    while not law.terminal(prefix):
        support = np.flatnonzero(law.row(prefix) > 0.0)
        if len(support) != 1:
            return False
        prefix += (int(support[0]),)
    return True


def size_samples(
    target,
    prompts: Sequence[tuple[str, torch.Tensor]],
    *,
    sampling: Sampling,
    length: int,
    eos_ids: set[int],
    detect_tv: float,
    alpha: float,
    max_cells: int = 200,
    limit: int = 10_000_000,
) -> int:
    """Samples per prompt so that every prompt's joint test detects a cell-level
    TV of `detect_tv` with 80% power at Holm's first-step level.

    The cells, hence df, depend on n: iterate n <- samples_for_tv(df(n))
    from below until n suffices (df grows with n, so this stops at the
    smallest such n; max_cells bounds df, so it does stop). A single cell
    (df 0) is never enough, whatever `samples_for_tv` says for one degree of
    freedom (a TV of 0.4 or more asks for fewer samples than two cells of
    MIN_EXPECTED need): n then grows to the smallest n with two cells. A
    prompt whose law no n splits is left to the others (its tests keep df 0);
    when that is every prompt, sizing stops with an error.
    """
    level = alpha / (len(TESTS) * len(prompts))

    def too_many():
        return HarnessError(f"exactness.detect_tv={detect_tv} needs over {limit} samples per prompt: ask for a larger TV")

    def df_at(law, n):
        return len(Partition.build(law, n, length, min_expected=min_expected_for(n, max_cells)).probs) - 1

    # Past this n the cells no longer change: a child is split when its mass reaches max(MIN_EXPECTED / n, 1 / max_cells).
    settled = math.ceil(MIN_EXPECTED * max_cells)
    needed, unsplit = 0, []  # unsplit: per prompt no n splits, whether its law has one continuation
    for _, ids in prompts:
        law = TargetLaw(target, ids, sampling, eos_ids, length)
        n = samples_for_tv(detect_tv, 1, level)
        if n > limit:
            raise too_many()
        for _ in range(100):
            df = df_at(law, n)
            if df == 0:  # one cell: nothing to test at this n
                single = one_continuation(law)
                low, high = n, max(2 * n, math.ceil(2 * MIN_EXPECTED))  # two cells need at least twice MIN_EXPECTED
                while not single and low < settled and df_at(law, high) == 0:
                    low, high = high, max(high, min(2 * high, settled))
                if single or low >= settled:
                    unsplit.append(single)
                    n = None
                    break
                while high - low > 1:  # the smallest n with two cells, between low (one) and high (two)
                    mid = (low + high) // 2
                    low, high = (low, mid) if df_at(law, mid) > 0 else (mid, high)
                n = high
                if n > limit:
                    raise too_many()
                continue
            want = samples_for_tv(detect_tv, df, level)
            if want <= n:
                break
            n = want
            if n > limit:
                raise too_many()
        if n is not None:
            needed = max(needed, n)
    if len(unsplit) == len(prompts):
        if all(unsplit):
            raise HarnessError(
                f"these settings (top_k={sampling.top_k}, temperature={sampling.temperature:g}) leave the target "
                f"one continuation of every prompt: nothing to test; raise top_k or the temperature"
            )
        raise HarnessError(
            f"the target's continuations of every prompt are too concentrated for two cells of 1/{max_cells} "
            f"of the mass each: nothing to test; raise exactness.max_cells (or the temperature)"
        )
    return needed


def no_verdict_error(report: dict) -> str:
    """The `error:` line of a check whose every test has a single cell (df 0), saying whether N was given or sized."""
    head = "every test has a single cell, so the check tested nothing: "
    one = "these settings leave the target one continuation (top_k=1: nothing to test)"
    if report.get("detect_tv_asked") is None:
        return (
            head + f"either exactness.samples={report['samples']} is too few to split the continuations (raise it, "
            f"or null to size it for exactness.detect_tv), or {one}"
        )
    return (
        head + f"N={report['samples']}, sized from exactness.detect_tv={report['detect_tv_asked']:g}, gives one cell: "
        f"either {one}, or set exactness.samples to more than {report['samples']}"
    )


# ---------------------------------------------------------------- reporting


def format_report(report: dict) -> str:
    """The table a person reads: one line per prompt and test, then the TV
    estimates, the cells furthest off when the check fails, and the verdict."""
    r = report
    lines = [
        f"exactness check: k={r['k']} temperature={r['temperature']} top_k={r['top_k']} top_p={r['top_p']} "
        f"L={r['length']} tokens, N={r['samples']} continuations per prompt",
        f"family: {r['tests_in_family']} tests, Holm-corrected, alpha={r['alpha']:g}; "
        f"detectable TV: the cell-level TV caught with {r['power']:.0%} power at level alpha/{r['tests_in_family']}",
        "",
        f"{'prompt':<22}{'test':<7}{'cells':>6}{'df':>6}{'G':>10}{'p':>11}{'p (Holm)':>11}{'detect. TV':>12}",
    ]
    for name, p in r["prompts"].items():
        for test, t in p["tests"].items():
            tv = "-" if t["detectable_tv"] is None else f"{t['detectable_tv']:.4f}"
            lines.append(
                f"{name[:21]:<22}{test:<7}{t['cells']:>6}{t['df']:>6}{t['statistic']:>10.1f}"
                f"{t['p_value']:>11.3g}{t['p_holm']:>11.3g}{tv:>12}"
            )
    lines += [
        "",
        f"{'prompt':<22}{'TV (joint cells)':>17}{'95% upper bound':>17}{'exact sampler: median, 95%':>29}{'zero-prob':>11}",
    ]
    for name, p in r["prompts"].items():
        tv = p["tv"]
        ci = "-" if tv["upper95"] is None else f"{tv['upper95']:.4f}"
        exact = "{:.4f}, {:.4f}".format(tv["exact_median"], tv["exact_95"])
        lines.append(f"{name[:21]:<22}{tv['tv']:>17.4f}{ci:>17}{exact:>29}{p['zero_probability_samples']:>11}")
    few = [name for name, p in r["prompts"].items() if p["tests"]["joint"]["cells"] < FEW_CELLS]
    if few:
        lines += [
            "",
            f"note: {', '.join(few)}: fewer than {FEW_CELLS} joint cells. The target's continuations of "
            "such a prompt hardly vary (often it ends at EOS at once), so the check sees little there: "
            "prefer prompts whose continuations vary (e.g. the chat template rather than raw text).",
        ]
    zero = sum(p["zero_probability_samples"] for p in r["prompts"].values())
    dtype = (r.get("conditions") or {}).get("dtype", "float32")
    if zero and dtype not in ("float32", "float64") and (r["top_k"] or r["top_p"] < 1):
        lines += [
            "",
            f"note: {zero} continuations have probability 0 under the target's exact law. In {dtype}, with top-k / "
            "top-p truncating, the loop's passes and the law's single pass can round a token at the truncation "
            "edge to opposite sides: rerun with dtype=float32 to tell rounding from a sampler bug.",
        ]
    if not r["passed"]:
        lines += ["", "cells furthest from their expected counts (joint test):"]
        for name, p in r["prompts"].items():
            for c in p["worst_cells"][:3]:
                label = c.get("text", " ".join(map(str, c["prefix"])))
                lines.append(
                    f"  {name[:21]:<22}{c['kind']:<6} {label!r:<32} observed {c['observed']}, expected {c['expected']:.1f}"
                )
    if r.get("dtype_note"):
        lines += ["", f"note: {r['dtype_note']}."]
    verdict = (
        "PASS: no test rejects"
        if r["passed"]
        else "FAIL: exactness rejected"
        if r.get("testable", True)
        else "NO VERDICT: every test has a single cell (df 0), so none could reject"
    )
    lines += ["", f"{verdict} (smallest Holm p = {r['family_p']:.3g}, alpha = {r['alpha']:g})"]
    if "run_dir" in r:
        lines.append(f"results: {r['run_dir']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the teacher-forced acceptance check


def acceptance_check(pair, prompts: Sequence[tuple[str, torch.Tensor]], k: int, max_new_tokens: int) -> dict:
    """Decode each prompt greedily with the pair and `k`, then check its cycles against the drafter's
    own proposals from a fresh state (harness.exactness.acceptance.teacher_forced_agreement). Per
    drafted position (1..k): the positions the loop tested, the drafts it reported accepted, the
    drafts a fresh drafter agrees with, and the disagreements, those within the draft's rounding
    (ties) apart. Passes when no position disagrees beyond a tie and every cycle drafted as many
    tokens as a fresh drafter proposes."""
    from harness.core.loop import speculative_decode
    from harness.exactness.acceptance import GREEDY, teacher_forced_agreement

    positions = [{"tested": 0, "reported_accepted": 0, "teacher_forced_agrees": 0, "ties": 0, "disagree": 0} for _ in range(k)]
    per_prompt, kind = {}, None
    for name, ids in prompts:
        cycles = list(speculative_decode(pair.target, pair.drafter, ids, k, GREEDY, max_new_tokens, pair.eos_ids, None))
        agreement = teacher_forced_agreement(pair.drafter, ids, cycles, k, max_new_tokens, target=pair.target)
        kind = agreement.kind
        for p in agreement.positions:
            row = positions[p.offset]
            row["tested"] += 1
            row["reported_accepted"] += int(p.reported)
            row["teacher_forced_agrees"] += int(p.agrees)
            row["ties"] += int(p.tie)
            row["disagree"] += int(p.reported != p.agrees and not p.tie)
        per_prompt[name] = {
            "passed": agreement.ok,
            "verdict": agreement.describe(),
            "reported": list(agreement.reported),  # (accepted, tested) as the loop yielded them
            "teacher_forced": list(agreement.teacher_forced),  # (accepted, tested) by the fresh drafter
            "ties": len(agreement.ties),
            "disagree": len(agreement.mismatches),
            "drafted_differs": [list(d) for d in agreement.drafted],  # [cycle, loop drafted, fresh drafted]
        }
    return {
        "check": "acceptance",
        "kind": kind,
        "k": k,
        "max_new_tokens": max_new_tokens,
        "positions": positions,
        "prompts": per_prompt,
        "passed": all(p["passed"] for p in per_prompt.values()),
    }


def format_acceptance(report: dict) -> str:
    """The acceptance check's table: per drafted position, the acceptance the loop reported beside
    the teacher-forced agreement, then the verdict and, on failure, each failing prompt's first disagreement."""
    r = report

    def share(count: int, tested: int) -> str:
        return f"{count} ({count / tested:.3f})" if tested else "0"

    lines = [
        f"teacher-forced acceptance check, {r['kind']}: k={r['k']}, greedy, up to {r['max_new_tokens']} new tokens, "
        f"{len(r['prompts'])} prompts",
        "",
        f"{'position':>8}{'tested':>8}{'reported accepted':>20}{'teacher-forced agrees':>24}{'ties':>6}{'disagree':>10}",
    ]
    for i, row in enumerate(r["positions"], 1):
        lines.append(
            f"{i:>8}{row['tested']:>8}{share(row['reported_accepted'], row['tested']):>20}"
            f"{share(row['teacher_forced_agrees'], row['tested']):>24}{row['ties']:>6}{row['disagree']:>10}"
        )
    failing = {name: p for name, p in r["prompts"].items() if not p["passed"]}
    if failing:
        lines += ["", *(f"  {name[:21]}: {p['verdict']}" for name, p in failing.items())]
    disagree = sum(row["disagree"] for row in r["positions"])
    lines.append("")
    lines.append(
        "PASS: the acceptance the loop reports is the draft's own at every tested position"
        if r["passed"]
        else f"FAIL: reported acceptance is not the draft's own: {disagree} positions disagree beyond a tie, "
        f"{sum(len(p['drafted_differs']) for p in failing.values())} cycles drafted other lengths ({len(failing)} prompts)"
    )
    if "run_dir" in r:
        lines.append(f"results: {r['run_dir']}")
    return "\n".join(lines)
