"""Is the speculative loop lossless? A goodness-of-fit check against the target's exact law.

Speculative decoding promises that its committed tokens are distributed
exactly as if the target had produced them alone. This module tests that
promise on the loop users run (`harness.core.loop.speculative_decode`, with the
configured pair, k, temperature, top-k and top-p), as a statistician would:

  draw      N independent speculative continuations of L tokens after a
            prompt, each with its own seeded generator. L defaults to k + 2,
            so every continuation crosses at least one cycle boundary.
  law       the target's exact probability of any continuation is a product
            of its own shaped rows, computed by teacher forcing
            (`TargetLaw`). Nothing about the law is estimated.
  cells     sequence space is cut into cells from the exact law alone,
            before looking at a single sample (`Partition`): a prefix tree
            in which a child token whose expected count is at least
            `min_expected` gets its own subtree and the rest of the node is
            pooled into one "prefix + other" cell. Remainders too small to
            stand alone go to one shared pooled cell.
  tests     per prompt, three G-tests (likelihood-ratio chi-square) of
            observed against expected cell counts:
              joint  the L-token continuation;
              first  the first token alone;
              bonus  the bonus token of the first cycle, in samples whose
                     first cycle accepted every draft. Conditioned on the
                     accepted drafts x_1..x_k', the bonus must follow the
                     target's row after them: the acceptance coins never
                     look at the bonus draw. Samples are grouped by their
                     accepted prefix, each group is tested against its own
                     row (cells pooled the same way, given the group size)
                     and the G statistics and degrees of freedom add up.
            A sample the target gives probability 0 (a token outside top-k
            or top-p, say) fails the check outright.
  family    p-values over prompts x tests are Holm-corrected; the check
            passes when no adjusted p-value falls below alpha.

Power is shown, not assumed. Against the cell law pi, an alternative law r
shifts the G (and Pearson) statistic by the noncentrality
lambda = N sum_c (r_c - pi_c)^2 / pi_c >= N (sum_c |r_c - pi_c|)^2 = 4 N d^2
(Cauchy-Schwarz, since sum_c pi_c = 1), where d is the total variation
between the two cell laws. With lambda* the noncentrality at which a
level-a chi-square test with df degrees of freedom rejects 80% of the time
(scipy.stats.ncx2), every alternative with d >= sqrt(lambda* / 4N) is caught
at least that often, whatever its direction: that is the "detectable TV"
reported, and `samples_for_tv` inverts it to size N. Two consequences:
cells must be few (lambda* grows with df, so at a fixed expected count per
cell the detectable TV stops shrinking with N; `max_cells` raises the
expected count instead), and a difference that cancels inside a pooled
cell is invisible, so the guarantee is about the law of the cells.

The tests in tests/test_exactness.py run this same check on deliberately
broken samplers (tests/broken.py, unreachable from any configuration) and
require each to be rejected at the N the correct loop passes at.

Command line (a Hydra app on conf/, thin over `run_check`):

    python -m harness.exactness +pair=smollm2 k=4 temperature=1.0 exactness.detect_tv=0.05

writes `exactness.json` into `<out_dir>/exactness-<cell key>/`, prints a
table and exits 0 when the check passes, 1 when it rejects exactness and 2
on bad input. docs/exactness.md explains how to read it.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import traceback
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from scipy import stats
from scipy.optimize import brentq

import harness.tracking.tracker as tracking
from harness.config.checks import CONF_DIR
from harness.errors import HarnessError
from harness.core.loop import speculative_decode
from harness.models.cached import CachedLM
from harness.core.rule import verify
from harness.core.sampling import Sampling, shape_probs

TESTS = ("joint", "first", "bonus")
MIN_EXPECTED = 20.0  # smallest expected count of a cell: the chi-square approximation holds above it
POWER = 0.8  # the detectable TV is the one caught this often
FEW_CELLS = 8  # a joint test with fewer cells than this gets a note: the prompt's continuations hardly vary


# ---------------------------------------------------------------- drawing


class Draw(NamedTuple):
    """One speculative continuation."""

    tokens: tuple[int, ...]  # the committed tokens, L of them unless an EOS came first
    bonus_prefix: tuple[int, ...] | None  # first cycle's accepted drafts, when it accepted them all
    bonus: int | None  # and the bonus token it then committed


class PromptKept:
    """A model's cache that keeps one prompt's prefix between continuations.

    Every continuation of a prompt starts from the same cache state: the
    prompt minus its last token (the loop's cache invariant). Instead of
    emptying the cache and prefilling the prompt again for each of N
    continuations, `reset()` rolls back to that prefix (the same `rollback`
    the loop uses after a rejection) and a prefill of exactly that prefix is
    skipped. The loop itself is unchanged: it feeds `ids[length:]`, now the
    prompt's last token and the drafts. The first continuation runs from an
    empty cache, as in a run, and so does every one whose cache cannot roll
    back that far (sliding-window layers drop what leaves their window).
    """

    def __init__(self, lm: CachedLM, prompt_ids: torch.Tensor):
        self.lm, self.keep = lm, prompt_ids.shape[0] - 1
        self.warm = False  # the cache holds the prompt's first `keep` tokens

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def reset(self) -> None:
        if self.warm and self.lm.can_roll_back(self.keep):  # sliding-window layers: only while within the window
            self.lm.rollback(self.keep)
        else:
            self.warm = False
            self.lm.reset()

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if self.warm and self.lm.length == self.keep == input_ids.shape[0]:
            return None  # the kept prefix (callers that prefill it ignore its logits)
        out = self.lm.prefill(input_ids)
        self.warm = self.lm.length >= self.keep
        return out

    def forward(self, input_ids: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        out = self.lm.forward(input_ids, num_logits)
        self.warm = self.lm.length >= self.keep
        return out


@contextmanager
def prompt_kept(target, drafter, prompt_ids: torch.Tensor):
    """(target, drafter) whose CachedLM caches keep the prompt between continuations.

    Only plain CachedLMs are wrapped: a test's deliberately broken target
    wrapper (one that does not roll back, say) keeps its own reset.
    """
    lm = getattr(drafter, "lm", None)
    if isinstance(lm, CachedLM):
        drafter.lm = PromptKept(lm, prompt_ids)
    try:
        yield (PromptKept(target, prompt_ids) if isinstance(target, CachedLM) else target), drafter
    finally:
        if isinstance(lm, CachedLM):
            drafter.lm = lm


def draw_continuations(
    target, drafter, prompt_ids: torch.Tensor, k: int, sampling: Sampling, length: int,
    eos_ids: set[int], samples: int, seed: int | Sequence[int], rule=verify, progress=None,
) -> list[Draw]:
    """`samples` independent runs of the real loop, each with its own seeded generator.

    Per-sample seeds are drawn without replacement from [0, 2^32) by a numpy
    generator seeded with `seed`: torch's CPU generator (mt19937) keeps only
    32 bits of a seed, so distinct 32-bit seeds are what keeps two samples
    from replaying the same stream. The prompt is prefilled once (`PromptKept`).
    """
    seeds = np.random.default_rng(np.random.SeedSequence(seed)).choice(2**32, size=samples, replace=False)
    generator = torch.Generator(target.device)
    draws = []
    with prompt_kept(target, drafter, prompt_ids) as (target, drafter):
        for s in seeds:
            generator.manual_seed(int(s))
            cycles = list(speculative_decode(target, drafter, prompt_ids, k, sampling, length, eos_ids, generator, rule=rule))
            first = cycles[0]
            # The bonus is observed when every draft was accepted and no EOS among them cut it off.
            has_bonus = 0 < first.num_drafted == first.num_accepted and len(first.tokens) == first.num_drafted + 1
            draws.append(Draw(
                tuple(t for c in cycles for t in c.tokens),
                tuple(first.tokens[:-1]) if has_bonus else None,
                first.tokens[-1] if has_bonus else None,
            ))
            if progress is not None:
                progress.update(1)
    return draws


# ---------------------------------------------------------------- the exact law


class TargetLaw:
    """The target's exact law of continuations of one prompt, by teacher forcing.

    A continuation is complete when it has `length` tokens or ends at its
    first EOS; its probability is the product of the target's shaped rows
    (the same `shape_probs` the loop applies) along it. Rows are memoised by
    prefix, so a tree of prefixes costs one forward per node.

    The law drives the target's cache itself: prefill the prompt once, feed a
    path, roll back. Whoever else uses the model in between must call
    `release()` so the prompt is prefilled again.
    """

    def __init__(self, target, prompt_ids: torch.Tensor, sampling: Sampling, eos_ids: set[int], length: int):
        self.target, self.prompt_ids, self.sampling = target, prompt_ids, sampling
        self.eos_ids, self.length = set(eos_ids), length
        self._rows: dict[tuple[int, ...], np.ndarray] = {}  # prefix -> [V] float64
        self._base: int | None = None  # cached prompt length while we own the cache

    def release(self) -> None:
        """Someone else is about to use the target's cache."""
        self._base = None

    def complete(self, seq: tuple[int, ...]) -> bool:
        return len(seq) == self.length or (len(seq) > 0 and seq[-1] in self.eos_ids)

    def terminal(self, prefix: tuple[int, ...]) -> bool:
        """No continuation grows past this prefix."""
        return len(prefix) >= self.length or (len(prefix) > 0 and prefix[-1] in self.eos_ids)

    def row(self, prefix: tuple[int, ...]) -> np.ndarray:
        """[V] the target's shaped distribution of the token after prompt + prefix."""
        if prefix not in self._rows:
            self._force(prefix)
        return self._rows[prefix]

    def possible(self, seq: tuple[int, ...]) -> bool:
        """Could the target's continuation be exactly seq? Judged factor by factor: the product of
        a long continuation's probabilities underflows to 0 in float64 (below about e^-745)."""
        if not self.complete(seq) or any(t in self.eos_ids for t in seq[:-1]):
            return False
        if seq[:-1] not in self._rows:
            self._force(seq[:-1])
        return all(self._rows[seq[:i]][t] > 0.0 for i, t in enumerate(seq))

    def _force(self, path: tuple[int, ...]) -> None:
        """Teacher-force prompt + path: memoise the row after each prefix of path."""
        target = self.target
        if self._base is None:
            target.reset()
            target.prefill(self.prompt_ids[:-1])
            self._base = target.length
        feed = torch.cat([self.prompt_ids[-1:], torch.tensor(path, dtype=torch.long, device=self.prompt_ids.device)])
        logits = target.forward(feed, num_logits=feed.shape[0])  # [len(path) + 1, V]
        target.rollback(self._base)
        probs = shape_probs(logits, self.sampling).double().cpu().numpy()  # [len(path) + 1, V]
        probs /= probs.sum(-1, keepdims=True)  # float32 rows sum to 1 only to ~1e-7
        for i in range(len(path) + 1):
            self._rows.setdefault(path[:i], probs[i])


# ---------------------------------------------------------------- cells


@dataclass
class Partition:
    """Cells of continuation space, built from the exact law alone.

    Walk the prefix tree from `root`: at each node, a child token whose
    expected count n * P(prefix + token) reaches `min_expected` is expanded
    (a terminal child, at `depth` tokens past the root or an EOS, is a cell
    of its own); the node's remaining mass is one "prefix + other" cell if
    it reaches `min_expected`, else it joins the shared pooled cell. A pooled
    cell still short of `min_expected` is merged into the smallest cell, so
    every expected count is at least `min_expected` (or there is one cell).
    """

    probs: np.ndarray  # [C] target probability of each cell
    labels: list[tuple[tuple[int, ...], str]]  # (prefix, "seq" | "other" | "pool") of each cell
    depth: int
    root: tuple[int, ...] = ()
    _split: dict = field(default_factory=dict)  # prefix -> expanded child tokens
    _rest: dict = field(default_factory=dict)  # prefix -> cell of its remainder
    _leaf: dict = field(default_factory=dict)  # terminal prefix -> its cell

    @classmethod
    def build(cls, law: TargetLaw, n: int, depth: int, root: tuple[int, ...] = (), min_expected: float = MIN_EXPECTED) -> Partition:
        part = cls(np.zeros(0), [], depth, root)
        probs: list[float] = []
        pool = -1  # index of the shared pooled cell, -1 until created
        pool_mass = 0.0

        def new_cell(mass: float, prefix: tuple[int, ...], kind: str) -> int:
            probs.append(mass)
            part.labels.append((prefix, kind))
            return len(probs) - 1

        # Depth first, most likely child first, each node's remainder after its children. An explicit
        # stack, not recursion: a near-deterministic law expands one node per token, past Python's limit.
        stack: list[tuple[tuple[int, ...], float, bool]] = [(root, 1.0, False)]  # (prefix, mass, is its remainder)
        while stack:
            prefix, mass, is_rest = stack.pop()
            if is_rest:  # the node's children are done: its remainder gets its cell now
                rest_mass = mass
                if n * rest_mass >= min_expected:
                    part._rest[prefix] = new_cell(rest_mass, prefix, "other")
                else:
                    if pool < 0:
                        pool = new_cell(0.0, (), "pool")
                    probs[pool] += rest_mass
                    pool_mass += rest_mass
                    part._rest[prefix] = pool
                continue
            if len(prefix) - len(root) >= depth or law.terminal(prefix):
                part._leaf[prefix] = new_cell(mass, prefix, "seq")
                continue
            row = law.row(prefix)  # [V]
            big = np.flatnonzero(n * mass * row >= min_expected)
            big = big[np.argsort(-row[big], kind="stable")]  # most likely first: a deterministic order
            part._split[prefix] = set(big.tolist())
            rest = np.ones_like(row, dtype=bool)
            rest[big] = False
            stack.append((prefix, mass * float(row[rest].sum()), True))  # summed directly: exact even when tiny
            stack.extend((prefix + (t,), mass * float(row[t]), False) for t in reversed(big.tolist()))

        part.probs = np.array(probs)
        if pool >= 0 and len(probs) > 1 and n * pool_mass < min_expected:
            others = [c for c in range(len(probs)) if c != pool]
            into = min(others, key=lambda c: probs[c])
            part._merge(pool, into)
        return part

    def _merge(self, cell: int, into: int) -> None:
        """Fold `cell` into `into`; the cells after `cell` move down by one."""
        moved = lambda c: c - (c > cell)
        renumber = lambda c: moved(into) if c == cell else moved(c)
        self.probs[into] += self.probs[cell]
        self.probs = np.delete(self.probs, cell)
        prefix, _ = self.labels[into]
        del self.labels[cell]
        self.labels[moved(into)] = (prefix, "pool")
        for table in (self._rest, self._leaf):
            for key, c in table.items():
                table[key] = renumber(c)

    def cell(self, seq: tuple[int, ...]) -> int:
        """The cell holding continuation seq (which starts with `root`)."""
        prefix = self.root
        while prefix not in self._leaf:
            nxt = seq[len(prefix)] if len(seq) > len(prefix) else None
            if nxt is None or nxt not in self._split[prefix]:
                return self._rest[prefix]
            prefix = prefix + (nxt,)
        return self._leaf[prefix]

    def counts(self, seqs: Sequence[tuple[int, ...]]) -> np.ndarray:
        """[C] observed count of each cell."""
        return np.bincount([self.cell(s) for s in seqs], minlength=len(self.probs)).astype(float)


def min_expected_for(n: int, max_cells: int) -> float:
    """Expected count per cell: at least MIN_EXPECTED, and large enough that
    there are at most about `max_cells` cells (see the module docstring)."""
    return max(MIN_EXPECTED, n / max_cells)


# ---------------------------------------------------------------- statistics


def g_test(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """(G statistic, degrees of freedom, p-value) of counts [C] against cell probabilities [C]."""
    n = counts.sum()
    if len(probs) < 2 or n == 0:
        return 0.0, 0, 1.0
    expected = n * probs / probs.sum()
    statistic, p_value = stats.power_divergence(counts, expected, lambda_="log-likelihood")
    return float(statistic), len(probs) - 1, float(p_value)


def noncentrality_for_power(df: int, level: float, power: float = POWER) -> float:
    """lambda* such that a level-`level` chi-square test with df degrees of
    freedom rejects a noncentral chi-square(df, lambda*) with probability `power`."""
    critical = stats.chi2.isf(level, df)
    shortfall = lambda lam: stats.ncx2.sf(critical, df, lam) - power
    high = 1.0
    while shortfall(high) < 0:
        high *= 2
    return brentq(shortfall, 1e-9, high)


def detectable_tv(n: int, df: int, level: float, power: float = POWER) -> float | None:
    """Smallest cell-level TV caught with probability `power` in every direction: sqrt(lambda*/4n)."""
    if df < 1 or n < 1:
        return None
    return math.sqrt(noncentrality_for_power(df, level, power) / (4 * n))


def samples_for_tv(tv: float, df: int, level: float, power: float = POWER) -> int:
    """Smallest n with detectable_tv(n, df, level) <= tv."""
    return math.ceil(noncentrality_for_power(max(df, 1), level, power) / (4 * tv * tv))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values: reject the i-th when its adjusted value is below alpha.
    Valid whatever the dependence between the tests (ours are strongly dependent)."""
    m = len(p_values)
    adjusted, running = [1.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def tv_upper_bound(statistic: float, df: int, n: int, confidence: float = 0.95) -> float | None:
    """An upper confidence bound on the cell-level TV, by inverting the G-test.

    Under a sampler whose cell law r differs from the exact law pi, G is
    (asymptotically) noncentral chi-square with noncentrality
    lambda = 2 n KL(r || pi) >= 4 n TV^2 (Pinsker). The largest lambda
    under which a G this small still has probability 1 - confidence bounds
    lambda, hence TV <= sqrt(lambda_upper / 4n). A bootstrap interval of the
    plug-in TV does not do this job: the plug-in is biased upward by noise,
    and so are its resamples.
    """
    if df < 1 or n < 1:
        return None
    tail = 1 - confidence
    if stats.chi2.cdf(statistic, df) <= tail:  # even lambda = 0 makes G look too small
        return 0.0
    excess = lambda lam: stats.ncx2.cdf(statistic, df, lam) - tail
    high = max(1.0, statistic)
    while excess(high) > 0:
        high *= 2
    return min(1.0, math.sqrt(brentq(excess, 0.0, high) / (4 * n)))


def tv_estimate(counts: np.ndarray, probs: np.ndarray, statistic: float, df: int, seed: int, resamples: int = 2000) -> dict:
    """The plug-in total variation between observed and exact cell laws, the
    range the same estimate takes when the sampler is exact (it is biased
    upward by noise: read it against `exact_median` and `exact_95`), and a
    95% upper confidence bound on the TV (`tv_upper_bound`)."""
    n = int(counts.sum())
    probs = probs / probs.sum()
    tv = lambda c: 0.5 * np.abs(c / n - probs).sum(-1)
    exact = tv(np.random.default_rng(seed).multinomial(n, probs, size=resamples))  # [resamples]
    return {"tv": float(tv(counts)), "upper95": tv_upper_bound(statistic, df, n),
            "exact_median": float(np.median(exact)), "exact_95": float(np.quantile(exact, 0.95))}


# ---------------------------------------------------------------- one prompt, then the family


def goodness_of_fit(law: TargetLaw, draws: Sequence[Draw], max_cells: int, seed: int = 0) -> dict:
    """The joint, first-token and bonus G-tests of one prompt's draws against its exact law."""
    n = len(draws)
    seqs = [d.tokens for d in draws]
    # Outright failures: continuations the target could never have produced.
    zero = sum(count for seq, count in Counter(seqs).items() if not law.possible(seq))
    min_expected = min_expected_for(n, max_cells)

    joint = Partition.build(law, n, law.length, min_expected=min_expected)
    joint_counts = joint.counts(seqs)
    first = Partition.build(law, n, 1, min_expected=min_expected)
    tests = {"joint": _result(*g_test(joint_counts, joint.probs), len(joint.probs), n),
             "first": _result(*g_test(first.counts(seqs), first.probs), len(first.probs), n)}
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

    expected = n * joint.probs
    worst = np.argsort(-np.abs(joint_counts - expected) / np.sqrt(expected))[:5]
    return {
        "samples": n, "zero_probability_samples": zero, "min_expected": min_expected, "tests": tests,
        "tv": tv_estimate(joint_counts, joint.probs, tests["joint"]["statistic"], tests["joint"]["df"], seed),
        "worst_cells": [{"prefix": list(joint.labels[c][0]), "kind": joint.labels[c][1],
                         "observed": int(joint_counts[c]), "expected": float(expected[c])} for c in worst],
    }


def _result(statistic: float, df: int, p_value: float, cells: int, observations: int) -> dict:
    return {"statistic": statistic, "df": df, "p_value": p_value, "cells": cells, "observations": observations}


def check(
    target, drafter, prompts: Sequence[tuple[str, torch.Tensor]], *, k: int, sampling: Sampling, length: int,
    samples: int, eos_ids: set[int] = frozenset(), seed: int = 0, alpha: float = 1e-3, max_cells: int = 200,
    rule=verify, law_target=None, progress: bool = False,
) -> dict:
    """Run the exactness check over prompts [(name, ids [T])]; returns the report.

    `law_target` computes the exact law (default: `target`). Tests pass the
    honest model here while `target` is a deliberately broken wrapper of it.
    """
    from tqdm import tqdm

    if sampling.greedy:
        raise HarnessError("the exactness check tests a sampling law: set temperature > 0 (e.g. temperature=1.0)")
    if length < 2:
        raise HarnessError(f"exactness.length={length} must be at least 2")
    bar = tqdm(total=samples * len(prompts), desc="speculative samples", unit="sample", file=sys.stderr, disable=not progress)
    per_prompt = {}
    for index, (name, ids) in enumerate(prompts):
        law = TargetLaw(law_target if law_target is not None else target, ids, sampling, eos_ids, length)
        draws = draw_continuations(target, drafter, ids, k, sampling, length, eos_ids, samples, (seed, index), rule, bar)
        per_prompt[name] = goodness_of_fit(law, draws, max_cells, seed=seed)
    bar.close()

    family = [(name, test) for name in per_prompt for test in TESTS]
    adjusted = holm([per_prompt[name]["tests"][test]["p_value"] for name, test in family])
    level = alpha / len(family)  # Holm's first step: the power below is for this level
    for (name, test), p_holm in zip(family, adjusted):
        result = per_prompt[name]["tests"][test]
        result["p_holm"] = p_holm
        result["detectable_tv"] = detectable_tv(result["observations"], result["df"], level)
    joint_detectable = [r["tests"]["joint"]["detectable_tv"] for r in per_prompt.values()]
    # Whether anything could reject: a test with a degree of freedom, or a sample the target's law rules out.
    testable = (any(per_prompt[name]["tests"][test]["df"] > 0 for name, test in family)
                or any(p["zero_probability_samples"] for p in per_prompt.values()))
    return {
        "passed": testable and min(adjusted) >= alpha,
        "testable": testable,
        "family_p": min(adjusted),
        "alpha": alpha,
        "tests_in_family": len(family),
        "detectable_tv": max((d for d in joint_detectable if d is not None), default=None),
        "power": POWER,
        "k": k, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
        "length": length, "samples": samples, "seed": seed, "max_cells": max_cells,
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
    target, prompts: Sequence[tuple[str, torch.Tensor]], *, sampling: Sampling, length: int, eos_ids: set[int],
    detect_tv: float, alpha: float, max_cells: int = 200, limit: int = 10_000_000,
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
    too_many = lambda: HarnessError(f"exactness.detect_tv={detect_tv} needs over {limit} samples per prompt: ask for a larger TV")
    df_at = lambda law, n: len(Partition.build(law, n, length, min_expected=min_expected_for(n, max_cells)).probs) - 1
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
            raise HarnessError(f"these settings (top_k={sampling.top_k}, temperature={sampling.temperature:g}) leave the target "
                               f"one continuation of every prompt: nothing to test; raise top_k or the temperature")
        raise HarnessError(f"the target's continuations of every prompt are too concentrated for two cells of 1/{max_cells} "
                           f"of the mass each: nothing to test; raise exactness.max_cells (or the temperature)")
    return needed


def no_verdict_error(report: dict) -> str:
    """The `error:` line of a check whose every test has a single cell (df 0), saying whether N was given or sized."""
    head = "every test has a single cell, so the check tested nothing: "
    one = "these settings leave the target one continuation (top_k=1: nothing to test)"
    if report.get("detect_tv_asked") is None:
        return (head + f"either exactness.samples={report['samples']} is too few to split the continuations (raise it, "
                f"or null to size it for exactness.detect_tv), or {one}")
    return (head + f"N={report['samples']}, sized from exactness.detect_tv={report['detect_tv_asked']:g}, gives one cell: "
            f"either {one}, or set exactness.samples to more than {report['samples']}")


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
        for test in TESTS:
            t = p["tests"][test]
            tv = "-" if t["detectable_tv"] is None else f"{t['detectable_tv']:.4f}"
            lines.append(f"{name[:21]:<22}{test:<7}{t['cells']:>6}{t['df']:>6}{t['statistic']:>10.1f}"
                         f"{t['p_value']:>11.3g}{t['p_holm']:>11.3g}{tv:>12}")
    lines += ["", f"{'prompt':<22}{'TV (joint cells)':>17}{'95% upper bound':>17}{'exact sampler: median, 95%':>29}{'zero-prob':>11}"]
    for name, p in r["prompts"].items():
        tv = p["tv"]
        ci = "-" if tv["upper95"] is None else f"{tv['upper95']:.4f}"
        exact = "{:.4f}, {:.4f}".format(tv["exact_median"], tv["exact_95"])
        lines.append(f"{name[:21]:<22}{tv['tv']:>17.4f}{ci:>17}{exact:>29}{p['zero_probability_samples']:>11}")
    few = [name for name, p in r["prompts"].items() if p["tests"]["joint"]["cells"] < FEW_CELLS]
    if few:
        lines += ["", f"note: {', '.join(few)}: fewer than {FEW_CELLS} joint cells. The target's continuations of "
                      "such a prompt hardly vary (often it ends at EOS at once), so the check sees little there: "
                      "prefer prompts whose continuations vary (e.g. the chat template rather than raw text)."]
    zero = sum(p["zero_probability_samples"] for p in r["prompts"].values())
    dtype = (r.get("conditions") or {}).get("dtype", "float32")
    if zero and dtype not in ("float32", "float64") and (r["top_k"] or r["top_p"] < 1):
        lines += ["", f"note: {zero} continuations have probability 0 under the target's exact law. In {dtype}, with top-k / "
                      "top-p truncating, the loop's passes and the law's single pass can round a token at the truncation "
                      "edge to opposite sides: rerun with dtype=float32 to tell rounding from a sampler bug."]
    if not r["passed"]:
        lines += ["", "cells furthest from their expected counts (joint test):"]
        for name, p in r["prompts"].items():
            for c in p["worst_cells"][:3]:
                label = c.get("text", " ".join(map(str, c["prefix"])))
                lines.append(f"  {name[:21]:<22}{c['kind']:<6} {label!r:<32} observed {c['observed']}, expected {c['expected']:.1f}")
    if r.get("dtype_note"):
        lines += ["", f"note: {r['dtype_note']}."]
    verdict = ("PASS: no test rejects" if r["passed"] else "FAIL: exactness rejected" if r.get("testable", True)
               else "NO VERDICT: every test has a single cell (df 0), so none could reject")
    lines += ["", f"{verdict} (smallest Holm p = {r['family_p']:.3g}, alpha = {r['alpha']:g})"]
    if "run_dir" in r:
        lines.append(f"results: {r['run_dir']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the command line

# Defaults of the `exactness` config node, overridable as exactness.<key>=...
DEFAULTS = {
    "samples": None,  # continuations per prompt; null: sized from detect_tv
    "detect_tv": 0.05,  # size N so that a cell-level TV this large is caught with 80% power
    "length": None,  # L, tokens per continuation; null: k + 2, so every continuation crosses a cycle boundary
    "num_prompts": 3,  # the first prompts of the configured dataset (chosen as `python -m harness` chooses them)
    "alpha": 0.001,  # family-wise level, Holm over prompts x tests
    "max_cells": 200,  # bound on cells per test (see the module docstring)
}

# The primary config is conf/config.yaml plus this node, so every run option
# (+pair=, k=, temperature=, top_k=, top_p=, seed=, out_dir=, ...) means here
# what it means for `python -m harness`.
ConfigStore.instance().store(name="exactness_check", node={"defaults": ["config", "_self_"], "exactness": DEFAULTS})


def validate_exactness(cfg: DictConfig) -> None:
    e = cfg.exactness
    unknown = set(e) - set(DEFAULTS)
    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    checks = [
        (not unknown, f"unknown exactness option(s) {sorted(unknown)}: known are {', '.join(DEFAULTS)}"),
        (cfg.temperature > 0, f"temperature={cfg.temperature} is greedy: the exactness check tests a sampling law, set temperature > 0 (e.g. temperature=1.0)"),
        (e.samples is None or (is_int(e.samples) and e.samples >= 20), f"exactness.samples={e.samples} must be an integer >= 20, or null (sized from exactness.detect_tv)"),
        (isinstance(e.detect_tv, (int, float)) and 0 < e.detect_tv < 1, f"exactness.detect_tv={e.detect_tv} must be in (0, 1), e.g. 0.05"),
        (e.length is None or (is_int(e.length) and e.length >= 2), f"exactness.length={e.length} must be an integer >= 2, or null (k + 2)"),
        (is_int(e.num_prompts) and e.num_prompts >= 1, f"exactness.num_prompts={e.num_prompts} must be a positive integer"),
        (isinstance(e.alpha, float) and 0 < e.alpha < 1, f"exactness.alpha={e.alpha} must be in (0, 1), e.g. 0.001"),
        (is_int(e.max_cells) and e.max_cells >= 2, f"exactness.max_cells={e.max_cells} must be an integer >= 2"),
    ]
    for ok, message in checks:
        if not ok:
            raise HarnessError(message)


HALF = ("float16", "bfloat16")


def full_precision_for_truncation(cfg: DictConfig, device: torch.device) -> str | None:
    """With top-k or top-p, run a model whose dtype is auto in float32 where auto would mean half
    precision (CUDA: bfloat16), and say so. A truncated law is defined there only up to rounding: the
    law's rows come from one pass over a continuation, the loop's from verify passes of other lengths,
    and a token at the truncation edge can fall on either side (SmolLM2 in bfloat16: a fifth of the
    rows, 1e-4 to 1e-3 of their mass), which the zero-probability rule fails outright.

    A dtype given explicitly is kept: dtype=bfloat16 checks in bfloat16. A model's dtype pinned on
    the pair (pair.target.dtype, pair.draft.dtype) is kept too, and the note says so: a target
    pinned to half precision may fail the check on rounding at the truncation edge; a draft's
    rounding is harmless (verify uses the very rows it sampled from), but it is named, so that the
    note never claims float32 for a model that is not in it."""
    from harness.models.loading import resolve_dtype

    if not (cfg.top_k > 0 or cfg.top_p < 1):
        return None
    auto = str(resolve_dtype("auto", device)).removeprefix("torch.")
    asked = cfg.dtype
    models = {"target": cfg.pair.target}
    if cfg.pair.draft.get("kind", "model") == "model":
        models["draft"] = cfg.pair.draft
    switched, kept = [], {}
    for name, node in models.items():
        dtype = node.get("dtype") or "auto"  # as the loader resolves it (${dtype} unless the pair pins its own)
        if dtype == "auto" and auto in HALF:
            with open_dict(node):
                node.dtype = "float32"
            switched.append(name)
        elif dtype in HALF and dtype != asked:  # pinned on the pair, not the dtype= asked for
            kept[name] = dtype
    if switched and asked == "auto":
        cfg.dtype = "float32"
    edge = lambda half: (f"top-k / top-p in {half} would put tokens at the truncation edge on either side "
                         f"from one pass shape to another")
    if "target" in kept:
        t = kept["target"]
        return (f"{edge(t)}: pair.target.dtype={t} is pinned, so the target stays in {t} and the check may fail on "
                f"rounding at the truncation edge (pair.target.dtype=float32 rules that out)"
                + ("; the draft is checked in float32" if "draft" in switched else ""))
    if not switched:
        return None
    if "draft" in kept:
        return (f"{edge(auto)}: checking the target in float32; the draft stays in {kept['draft']}, pinned by "
                f"pair.draft.dtype (harmless: verify uses the rows the draft sampled from)")
    return f"{edge(auto)}: checking in float32 (dtype=bfloat16 checks in bfloat16)"


def chosen_prompts(cfg: DictConfig) -> list[dict]:
    """The first `exactness.num_prompts` prompts of the configured dataset, as `python -m harness` chooses them."""
    from harness.data.datasets import load_prompts
    from harness.data.prompts import select

    return select(load_prompts(cfg.dataset), cfg.exactness.num_prompts, cfg.seed, cfg.prompts.shuffle)


def encode_prompts(cfg: DictConfig, pair, length: int, chosen: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """The chosen prompts (chosen_prompts), as `python -m harness` encodes them, within the context left by
    `length` tokens of continuation: cut (prompts.overlong=truncate) or left out (skip)."""
    from harness.data.prompts import as_tensor, encode_within

    budget = pair.prompt_budget(length)
    if budget < 1:
        raise HarnessError(f"exactness.length={length} leaves no room for a prompt in the pair's {pair.context}-token context: "
                           f"lower exactness.length")
    encoded = [(p["id"], encode_within(pair.tokenizer, p["prompt"], cfg.prompts.template, budget, cfg.prompts.overlong,
                                       "exactness.length")) for p in chosen]
    kept = [(pid, as_tensor(ids, pair.device)) for pid, ids in encoded if ids is not None]
    if not kept:
        raise HarnessError(f"every chosen prompt is longer than the context budget ({budget} tokens) and prompts.overlong=skip: "
                           f"lower exactness.length or use prompts.overlong=truncate")
    return kept


def run_check(cfg: DictConfig, quiet: bool = False) -> dict:
    """Load the configured pair, run the check on its first prompts, write
    exactness.json into the run directory and return the report. A run
    directory that already holds a report is not redone unless force=true."""
    from harness.config.checks import validate, with_default_pair
    from harness.runner.cell import cell_key, conditions, load_pair, measure_costs, resolve_device, _write_json_atomic

    cfg = with_default_pair(cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.exactness = OmegaConf.merge(DEFAULTS, cfg.get("exactness") or {})  # tolerate configs composed without our node
    validate(cfg)
    validate_exactness(cfg)
    device = resolve_device(cfg.device)
    dtype_note = full_precision_for_truncation(cfg, device)
    if dtype_note and not quiet:
        print(f"[harness] {dtype_note}", file=sys.stderr)
    e = cfg.exactness
    run_dir = Path(cfg.out_dir) / f"exactness-{cell_key(cfg)}"
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            run_dir.mkdir()
            created = True
        except FileExistsError:  # a check run before, or one of another process running now
            created = False
    except OSError as err:
        raise HarnessError(f"cannot write results to {run_dir}: {err.strerror}; set out_dir=<a writable directory>") from None
    report_path = run_dir / "exactness.json"
    if report_path.exists() and not cfg.force:
        if not quiet:
            print(f"[harness] exactness check already done, not re-run (force=true to redo): {run_dir}", file=sys.stderr)
        return json.loads(report_path.read_text())
    length = e.length if e.length is not None else cfg.k + 2
    try:
        chosen = chosen_prompts(cfg)  # first: a dataset problem should stop the check before a model loads
        # The pair exactly as `python -m harness` loads it: same cache kind, same compilation.
        pair = load_pair(cfg.pair, device, cfg.get("cache", "dynamic"), cfg.get("compile", False), cfg.get("cpu_linear", "auto"),
                         cfg.get("forward", "hf"))
        prompts = encode_prompts(cfg, pair, length, chosen)
    except BaseException:  # a check that cannot start leaves no empty folder of its own making
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # once the check can start
    sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))
    pair.reserve(max(ids.shape[0] for _, ids in prompts), length, cfg.k)
    pair.use_costs(measure_costs(pair, prompts[0][1], cfg.k, sampling))  # as run_cell does: the proposals a run makes

    started = time.perf_counter()
    samples = e.samples
    if samples is None:
        samples = size_samples(pair.target, prompts, sampling=sampling, length=length, eos_ids=pair.eos_ids,
                               detect_tv=e.detect_tv, alpha=e.alpha, max_cells=e.max_cells)
        if not quiet:
            print(f"[harness] {samples} continuations per prompt detect a TV of {e.detect_tv} (exactness.samples= to override)", file=sys.stderr)
    report = check(pair.target, pair.drafter, prompts, k=cfg.k, sampling=sampling, length=length, samples=samples,
                   eos_ids=pair.eos_ids, seed=cfg.seed, alpha=e.alpha, max_cells=e.max_cells, progress=not quiet)
    report.update(pair=cfg.pair.name, target=cfg.pair.target.id, draft=cfg.pair.draft.get("id", cfg.pair.draft.kind),
                  detect_tv_asked=None if e.samples is not None else e.detect_tv, time_s=time.perf_counter() - started,
                  conditions=conditions(cfg, pair), run_dir=str(run_dir), dtype_note=dtype_note)
    for p in report["prompts"].values():
        for c in p["worst_cells"]:
            c["text"] = pair.tokenizer.decode(c["prefix"])
    _write_json_atomic(report_path, report)
    tracker = tracking.start(cfg, run_dir, job_type="exactness")
    tracker.finish(tracking.exactness_summary(report), [], extra=tracking.exactness_media(report)
                   if isinstance(tracker, tracking.WandbTracker) else None)
    return report


# Exit status: 0 passed, 1 exactness rejected, 2 bad input, 3 the check itself failed (a traceback), 130 interrupted.
# In a multirun every job runs, and the process exits with the highest status of its jobs.
EXIT_CODES: list[int] = []


def _end(code: int) -> None:
    """Exit now in a single run, or in a multirun whose jobs run in processes of their own (SLURM's
    submitit: its launcher sees the failure); in a multirun run in this process, record the code
    and let the next job run."""
    from hydra.core.hydra_config import HydraConfig

    from harness.cli.callbacks import in_multirun

    in_process = in_multirun() and HydraConfig.get().launcher._target_.endswith("BasicLauncher")
    if code and not in_process:
        sys.exit(code)
    EXIT_CODES.append(code)


@hydra.main(config_path=str(CONF_DIR), config_name="exactness_check", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading bars would bury the table
    try:
        report = run_check(cfg)
    except KeyboardInterrupt:
        print("interrupted: the check writes its report only when it finishes; run the same command again", file=sys.stderr)
        sys.exit(130)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        return _end(err.exit_code)
    except Exception:  # a bug or a broken model, not a verdict: exit 1 would read as "not exact"
        traceback.print_exc()
        print("error: the check itself failed (traceback above): no verdict", file=sys.stderr)
        return _end(3)
    print(format_report(report))
    print(json.dumps({k: v for k, v in report.items() if k not in ("prompts", "conditions")}))
    if not report.get("testable", True):  # a report stored before the key existed had a verdict
        print(f"error: {no_verdict_error(report)}", file=sys.stderr)
        return _end(2)
    _end(0 if report["passed"] else 1)


def cli() -> None:
    """`python -m harness.exactness`: exits 1 when a check rejects the law, 2 on bad input."""
    from harness.config.checks import check_choices

    check_choices(sys.argv[1:], extra={"exactness": DEFAULTS})
    main()
    sys.exit(max(EXIT_CODES, default=0))
