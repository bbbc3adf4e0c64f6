"""Speculative decoding is lossless: deterministic and statistical tests.

Three layers, each shown to fail on deliberately broken samplers (tests/broken.py):
  one step   the rule's output law q min(1, p/q) + (1 - beta) norm(max(0, p - q))
             equals p within 1e-12, as a formula and as verify's code;
  whole loop every random draw of the REAL loop (drafted tokens, acceptance
             coins, recovered and bonus tokens) is enumerated with its exact
             probability on a trigram model: the law of the committed tokens
             is the target's within 1e-9 in total variation;
  sampling   the exactness check of harness.exactness, seeded, on the real
             loop over a grid of settings and on every variant, at N = 20,000
             (also at 50,000 with -m slow), and once on the tiny transformer pair.

The fake models (tests/markov.py) are float64 trigram tables: a target that
forgets to roll back its cache sees a stale token and gives a wrong row.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from contextlib import contextmanager

import broken
import numpy as np
import pytest
import torch
from broken import BROKEN, LOSSLESS, VARIANTS, per_row, plugged, variant_table
from conftest import (
    FAMILY_ALPHA,
    TINY_CHECK,
    TINY_K,
    TINY_LENGTH,
    TINY_SAMPLES,
    TINY_SAMPLING,
    compose_check,
    exactness_args,
    missing_rollback_report,
    tiny_cached_pair,
)
from hydra import compose, initialize_config_dir
from markov import markov_pair

import harness.core.drafters
import harness.core.rule
from harness.config.checks import CONF_DIR
from harness.core.drafters import ModelDrafter, NgramDrafter
from harness.core.lengths import make_policy
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.rule import verify, verify_rows
from harness.core.sampling import Sampling, shape_probs
from harness.errors import HarnessError
from harness.exactness.check import TESTS, check, format_report
from harness.exactness.law import Partition, TargetLaw, draw_continuations
from harness.exactness.main import run_check
from harness.exactness.stats import detectable_tv, g_test, holm, samples_for_tv

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors run on one intra-op thread


# ---------------------------------------------------------------- exact enumeration of random draws


class Branches:
    """Replays one path through the random draws and records the untaken ones.

    Every draw asks `choose(probs)`; the first run takes option 0 at each new
    draw and remembers the others as forks, so running every fork to the end
    visits every outcome once, with weight = the product of its choices'
    probabilities.
    """

    def __init__(self, script: list[int]):
        self.script, self.at, self.weight, self.forks = list(script), 0, 1.0, []

    def choose(self, probs: list[float]) -> int:
        if self.at == len(self.script):
            live = [i for i, w in enumerate(probs) if w > 0]
            self.forks += [self.script + [i] for i in live[1:]]
            self.script.append(live[0])
        choice = self.script[self.at]
        self.at += 1
        self.weight *= probs[choice]
        return choice


def first_rejection_probs(accept: list[float]) -> list[float]:
    """[k + 1] P(first rejection at position j), j = k meaning all accepted."""
    k = len(accept)
    return [math.prod(accept[:j]) * (1 - accept[j]) for j in range(k)] + [math.prod(accept)]


class Enumerator:
    """Deterministic stand-ins for the three random draws, driven by a Branches.

    sample(weights)   -> each token, with probability weight / sum;
    broken.coins(a)   -> each first-rejection position, with its probability;
    verify's torch.rand, through `wrap(verify)`: the wrapper computes
                         a_i = min(1, p_i(x_i)/q_i(x_i)) from verify's own
                         inputs, picks the first rejection j, and feeds verify
                         u = 0 before j (accepted whenever p > 0) and the
                         largest float below 1 at j (rejected whenever p < q).
                         It then asserts verify did accept exactly j drafts.
    """

    def __init__(self):
        self.branches: Branches | None = None
        self.pending_u: torch.Tensor | None = None

    def sample(self, weights, generator):
        w = weights.double()
        return torch.tensor(self.branches.choose((w / w.sum()).tolist()))

    def sample_rows(self, weights, generators):
        return torch.stack([self.sample(w, g) for w, g in zip(weights, generators)])

    def coins(self, accept_probs, generator):
        j = self.branches.choose(first_rejection_probs(accept_probs.double().tolist()))
        return torch.arange(accept_probs.shape[0]) < j

    def rand(self, *shape, generator=None, device=None, dtype=None):
        u, self.pending_u = self.pending_u, None
        assert u is not None and u.dtype == dtype, "torch.rand called outside the verify wrapper"
        return u

    def wrap(self, rule):
        def enumerated(draft_tokens, draft_probs, target_probs, generator):
            k = draft_tokens.shape[0]
            positions = torch.arange(k)
            p_x, q_x = target_probs[positions, draft_tokens], draft_probs[positions, draft_tokens]
            j = self.branches.choose(first_rejection_probs((p_x / q_x).clamp(max=1).double().tolist()))
            u = torch.zeros(k, dtype=p_x.dtype)
            if j < k:
                u[j] = torch.nextafter(torch.ones((), dtype=u.dtype), torch.zeros((), dtype=u.dtype))
            self.pending_u = u
            verdict = rule(draft_tokens, draft_probs, target_probs, generator)
            assert verdict.num_accepted == j, "verify did not accept with probability min(1, p/q)"
            return verdict

        return enumerated

    @contextmanager
    def installed(self):
        patches = [
            (harness.core.rule, "sample_rows", self.sample_rows),
            (harness.core.drafters, "sample_rows", self.sample_rows),
            (broken, "sample", self.sample),
            (broken, "coins", self.coins),
            (torch, "rand", self.rand),
        ]
        saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
        for m, n, v in patches:
            setattr(m, n, v)
        try:
            yield self
        finally:
            for m, n, v in saved:
                setattr(m, n, v)

    def law(self, run) -> dict:
        """{outcome: probability} of run(), visiting every branch of its draws."""
        law, stack = defaultdict(float), [[]]
        with self.installed():
            while stack:
                self.branches = Branches(stack.pop())
                outcome = run()
                law[outcome] += self.branches.weight
                stack += self.branches.forks
        return dict(law)


def loop_law(target, drafter, prompt, k, sampling, length, eos_ids=frozenset(), rule=None) -> dict:
    """Exact law of the committed tokens of the real speculative loop."""
    enum = Enumerator()
    # verify draws its coins with torch.rand: wrap it. The copies in broken.py draw through broken.coins.
    rule = per_row(enum.wrap(verify)) if rule is None else rule

    def run():
        cycles = speculative_decode(target, drafter, prompt, k, sampling, length, set(eos_ids), torch.Generator(), rule=rule)
        return tuple(t for c in cycles for t in c.tokens)

    return enum.law(run)


def target_law(law: TargetLaw) -> dict:
    """Exact law of the target's own continuations: every complete sequence with P > 0."""
    out, stack = {}, [((), 1.0)]
    while stack:
        prefix, mass = stack.pop()
        if law.terminal(prefix):
            out[prefix] = mass
            continue
        row = law.row(prefix)
        stack += [(prefix + (t,), mass * row[t]) for t in np.flatnonzero(row > 0).tolist()]
    return out


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in a.keys() | b.keys())


# ---------------------------------------------------------------- one step of the rule, exactly


def one_step_formula(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """q min(1, p/q) + (1 - beta) norm(max(0, p - q)), beta = sum min(p, q)."""
    kept = np.minimum(p, q)  # q min(1, p/q), also where q = 0
    beta = kept.sum()
    residual = np.maximum(p - q, 0.0)
    recovered = residual / residual.sum() if residual.sum() > 0 else np.zeros_like(p)
    return kept + (1 - beta) * recovered


def one_step_law(rule, p: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """[V] exact law of the token a rule commits first, for a draft x ~ q (k = 1)."""
    enum = Enumerator()
    rule = enum.wrap(rule) if rule is verify else rule
    bonus_row = torch.full_like(p, 1.0 / p.shape[0])

    def run():
        x = enum.sample(q, None)
        verdict = rule(x[None], q[None], torch.stack([p, bonus_row]), None)
        return int(x) if verdict.num_accepted == 1 else int(verdict.next_token)

    law = np.zeros(p.shape[0])
    for token, prob in enum.law(run).items():
        law[token] += prob
    return law


def _row(values) -> torch.Tensor:
    row = torch.tensor(values, dtype=torch.float64)
    return row / row.sum()


_gen = torch.Generator().manual_seed(7)
_logits = torch.randn(2, 6, generator=_gen, dtype=torch.float64)
EDGE_CASES = {
    "p equals q": (_logits[0].softmax(-1), _logits[0].softmax(-1)),
    "generic": (_logits[0].softmax(-1), _logits[1].softmax(-1)),
    "disjoint supports": (_row([0.5, 0.3, 0.2, 0, 0, 0]), _row([0, 0, 0, 0.1, 0.6, 0.3])),
    "one-hot p": (_row([0, 0, 1, 0, 0, 0]), _logits[1].softmax(-1)),
    "one-hot q": (_logits[0].softmax(-1), _row([0, 0, 0, 0, 1, 0])),
    "one-hot p and q, equal": (_row([0, 1, 0, 0, 0, 0]), _row([0, 1, 0, 0, 0, 0])),
    "top-k truncated rows": (shape_probs(_logits[0], Sampling(0.7, top_k=2)), shape_probs(_logits[1], Sampling(1.3, top_k=3))),
    "top-p truncated rows": (
        shape_probs(_logits[0], Sampling(1.0, top_p=0.6)),
        shape_probs(_logits[1], Sampling(1.0, top_p=0.8)),
    ),
    "tiny probabilities": (_row([1e-300, 1e-30, 1e-12, 0.5, 0.5, 1e-200]), _row([1e-200, 1e-300, 0.3, 0.7, 1e-15, 1e-30])),
    "p tiny where q is large": (_row([1e-280, 1, 1, 0, 0, 0]), _row([1, 1e-290, 1e-16, 0, 0, 0])),
}


@pytest.mark.parametrize("case", EDGE_CASES)
def test_one_step_law_is_p(case):
    p, q = EDGE_CASES[case]
    assert np.abs(one_step_formula(p.numpy(), q.numpy()) - p.numpy()).max() < 1e-12
    assert np.abs(one_step_law(verify, p, q) - p.numpy()).max() < 1e-12  # verify's own code
    # The copy the broken variants are built on has verify's law when its hooks are left alone.
    assert np.abs(one_step_law(broken.speculative_rule, p, q) - p.numpy()).max() < 1e-12


ONE_STEP_BUGS = {
    "accept_all": dict(acceptance=lambda p_x, q_x: torch.ones_like(p_x)),
    "resample_from_p": dict(residual=lambda p, q: p),
    "ratio_q_over_p": dict(acceptance=lambda p_x, q_x: (q_x / p_x).nan_to_num(posinf=1.0).clamp(max=1.0)),
    "residual_abs": dict(residual=lambda p, q: (p - q).abs()),
}


@pytest.mark.parametrize("bug", ONE_STEP_BUGS)
def test_one_step_law_catches_broken_rules(bug):
    p, q = EDGE_CASES["generic"]
    law = one_step_law(broken.rule_with(**ONE_STEP_BUGS[bug]), p, q)
    assert np.abs(law - p.numpy()).max() > 1e-2


# ---------------------------------------------------------------- the two draws, on a grid of uniforms
# The enumerations above feed verify u = 0 or u -> 1 only, and replace sample(): they check the
# rule's logic, not the probabilities of its draws. Here each draw is fed M uniforms spread evenly
# over [0, 1), so the share of outcomes is its probability to within 1/M.

M = 4096
U_GRID = (torch.arange(M, dtype=torch.float64) + 0.5) / M  # ascending


def _shape(shape: tuple) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape


def grid_rand(*shape, generator=None, device=None, dtype=None):
    """torch.rand's stand-in: the grid when M uniforms are asked for; 1/2 for any other draw
    (the recovered or bonus token after the coins)."""
    shape = _shape(shape)
    if math.prod(shape) != M:
        return torch.full(shape, 0.5, dtype=dtype)
    return U_GRID.to(dtype).reshape(shape)


def acceptance_on_grid(rule, p: torch.Tensor, q: torch.Tensor, x: int, monkeypatch) -> float:
    """Share of the grid's uniforms for which `rule` accepts draft x ~ q against p: M positions,
    each the same draft, fed ascending uniforms, so the accepted ones form a prefix."""

    monkeypatch.setattr(torch, "rand", grid_rand)
    verdict = rule(torch.full((M,), x), q.expand(M, -1), p.expand(M + 1, -1), None)
    monkeypatch.undo()
    return verdict.num_accepted / M


@pytest.mark.parametrize("case", ["generic", "disjoint supports", "one-hot q", "top-p truncated rows", "tiny probabilities"])
def test_verify_accepts_with_probability_min_1_p_over_q(case, monkeypatch):
    p, q = EDGE_CASES[case]
    for x in torch.nonzero(q).flatten().tolist():
        want = min(1.0, float(p[x] / q[x]))
        assert abs(acceptance_on_grid(verify, p, q, x, monkeypatch) - want) <= 1 / M, (case, x)


@pytest.mark.parametrize("bug", ["squared", "ratio_q_over_p"])
def test_acceptance_grid_catches_a_wrong_acceptance_probability(bug, monkeypatch):
    acceptance = {
        "squared": lambda p_x, q_x: (p_x / q_x).clamp(max=1.0) ** 2,
        "ratio_q_over_p": ONE_STEP_BUGS["ratio_q_over_p"]["acceptance"],
    }[bug]
    rule = broken.rule_with(acceptance=acceptance)
    p, q = EDGE_CASES["generic"]
    errors = [abs(acceptance_on_grid(rule, p, q, x, monkeypatch) - min(1.0, float(p[x] / q[x]))) for x in range(p.shape[0])]
    assert max(errors) > 0.05


def draw_shares(sampler, weights: torch.Tensor, monkeypatch) -> np.ndarray:
    """[V] share of the grid's uniforms for which `sampler` draws each index."""

    monkeypatch.setattr(torch, "rand", grid_rand)
    drawn = sampler(weights.expand(M, -1), None)  # [M]
    monkeypatch.undo()
    return np.bincount(drawn.numpy(), minlength=weights.shape[0]) / M


@pytest.mark.parametrize("case", ["generic", "disjoint supports", "one-hot p", "top-k truncated rows", "tiny probabilities"])
def test_sample_draws_each_index_with_probability_weight_over_total(case, monkeypatch):
    from harness.core.sampling import sample

    for weights in EDGE_CASES[case]:
        unnormalised = weights * 3.7  # sample() takes weights, not probabilities
        shares = draw_shares(sample, unnormalised, monkeypatch)
        assert np.abs(shares - weights.numpy()).max() <= 1 / M, case
        assert shares[weights.numpy() == 0].sum() == 0  # a zero weight is never drawn
    # the last uniform below 1 still lands on the last token with weight
    w = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(_shape(shape), 1 - 2**-53, dtype=torch.float64))
    assert int(sample(w, None)) == 1


def test_draw_shares_catch_a_wrong_sampler(monkeypatch):
    from harness.core.sampling import sample

    p = EDGE_CASES["generic"][0]
    squared = draw_shares(lambda w, g: sample(w**2, g), p, monkeypatch)  # a temperature bug
    assert np.abs(squared - p.numpy()).max() > 0.05


# ---------------------------------------------------------------- the whole loop, exactly

EXACT_CASES = {  # (k, sampling, L, eos_ids) on a 4-token trigram pair
    "k1 T1": (1, Sampling(1.0), 3, ()),
    "k2 T0.7 top-k3": (2, Sampling(0.7, top_k=3), 4, ()),
    "k3 T1 top-k2 top-p0.9": (3, Sampling(1.0, top_k=2, top_p=0.9), 5, ()),
    "k2 T1 top-k3 eos": (2, Sampling(1.0, top_k=3), 4, (0,)),
}
PROMPT = torch.tensor([1, 2, 3])


@pytest.mark.parametrize("case", EXACT_CASES)
def test_loop_law_is_target_law_exactly(case):
    k, sampling, length, eos = EXACT_CASES[case]
    target, draft = markov_pair(4, seed=0)
    exact = target_law(TargetLaw(target, PROMPT, sampling, set(eos), length))
    got = loop_law(target, ModelDrafter(draft), PROMPT, k, sampling, length, eos)
    assert abs(sum(got.values()) - 1) < 1e-12
    assert total_variation(got, exact) < 1e-9


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_loop_law_catches_broken_variants(variant):
    """Exact propagation rejects every bug by a wide margin and keeps every lossless control."""
    k, sampling, length = 2, Sampling(0.7, top_k=3), 3
    target, draft = markov_pair(4, seed=0)
    exact = target_law(TargetLaw(target, PROMPT, sampling, set(), length))
    with plugged(variant, target, ModelDrafter(draft)) as (t, d, rule):
        got = loop_law(t, d, PROMPT, k, sampling, length, rule=rule)
    tv = total_variation(got, exact)
    assert tv < 1e-9 if variant.lossless else tv > 1e-2, f"{variant.name}: TV {tv:.3g}"


def counting(drafter) -> set[int]:
    """The set, filled as the drafter proposes, of the lengths it proposed."""
    lengths, propose = set(), drafter.propose

    def counted(rows, budgets, sampling):
        proposal = propose(rows, budgets, sampling)
        lengths.add(proposal.counts[0])
        return proposal

    drafter.propose = counted
    return lengths


POLICIES = {
    "heuristic": lambda: make_policy("heuristic"),
    "confidence": lambda: make_policy("confidence", threshold=0.4),
    "confidence_auto": lambda: make_policy("confidence", threshold="auto"),
    "cost": lambda: costed(make_policy("cost")),
    "by_batch": lambda: make_policy("by_batch", table={1: 1}),
}


def costed(policy):
    policy.use_costs({"cost_ratio": 0.1, "verify_cost": [1.0, 1.05, 1.1, 1.15]})
    return policy


@pytest.mark.parametrize("name", POLICIES)
def test_draft_length_policies_keep_the_target_law_exactly(name):
    """Each policy (lengths chosen per cycle, or per position from the draft's own probabilities and the
    run's past outcomes) keeps the target's law exactly at T=1; lengths vary."""
    k, sampling, length = 2, Sampling(1.0), 4
    target, draft = markov_pair(4, seed=0)
    drafter = ModelDrafter(draft)
    lengths = counting(drafter)
    exact = target_law(TargetLaw(target, PROMPT, sampling, set(), length))
    enum = Enumerator()
    rule = per_row(enum.wrap(verify))

    def run():  # a new policy for every replay of the enumeration: the law of one run from its start
        drafter.draft_length = POLICIES[name]()
        cycles = speculative_decode(target, drafter, PROMPT, k, sampling, length, set(), torch.Generator(), rule=rule)
        return tuple(t for c in cycles for t in c.tokens)

    got = enum.law(run)
    assert total_variation(got, exact) < 1e-9
    assert len(lengths) > 1 or name == "by_batch", lengths  # the policy changed the length (by_batch: k=1 throughout)


@pytest.mark.parametrize("name", POLICIES)
def test_draft_length_policies_keep_greedy_output(name):
    target, draft = markov_pair(6, seed=3, draft_noise=2.0)
    drafter = ModelDrafter(draft)
    drafter.draft_length = POLICIES[name]()
    for prompt in ([1, 2], [3, 0, 5], [4, 4]):
        ids = torch.tensor(prompt)
        alone = list(autoregressive_decode(target, ids, Sampling(0.0), 12, set(), None))
        cycles = list(speculative_decode(target, drafter, ids, 3, Sampling(0.0), 12, set(), None))
        assert [t for c in cycles for t in c.tokens] == alone


def test_a_policy_that_peeks_at_the_target_is_caught_exactly():
    k, sampling, length = 2, Sampling(1.0), 4
    target, draft = markov_pair(4, seed=0)
    exact = target_law(TargetLaw(target, PROMPT, sampling, set(), length))
    got = loop_law(target, broken.PeekingDrafter(draft, target), PROMPT, k, sampling, length)
    assert total_variation(got, exact) > 1e-2


def cost_aware_lookup(vocab_size: int) -> NgramDrafter:
    # Lookup under draft_length=cost: lengths follow earlier outcomes (the row's acceptance at that n-gram length,
    # calibrated against the run's), down to none (a plain target step) once drafts stop paying.
    drafter = NgramDrafter(vocab_size)
    drafter.draft_length = make_policy("cost")
    drafter.draft_length.use_costs({"cost_ratio": 0.0, "verify_cost": [1.0, 1.3, 1.5]})
    return drafter


LOOKUP_BUGS = [v for v in BROKEN if v.name in ("accept_all", "resample_from_p", "residual_abs", "bonus_wrong_row", "no_rollback")]


@pytest.mark.parametrize("variant", [None, *LOOKUP_BUGS], ids=lambda v: v.name if v else "real_loop")
def test_cost_aware_lookup_law_is_target_law_exactly(variant):
    """Prompt lookup that proposes 0, 1 or 2 tokens by how its earlier proposals
    fared keeps the target's law exactly; the broken rules are caught with it."""
    k, sampling, length = 2, Sampling(1.0), 5
    target, _ = markov_pair(4, seed=0)
    prompt = torch.tensor([1, 2, 3, 1, 2])  # matches from the first cycle on
    drafter = cost_aware_lookup(4)
    lengths = counting(drafter)
    exact = target_law(TargetLaw(target, prompt, sampling, set(), length))
    plug = variant or broken.Variant("real_loop", True, "the real loop")
    policy, start = drafter.draft_length, drafter.start

    def fresh_policy(prompts):  # every replay of the enumeration starts from the same policy state
        drafter.draft_length = copy.deepcopy(policy)
        start(prompts)

    drafter.start = fresh_policy
    with plugged(plug, target, drafter) as (t, d, rule):
        got = loop_law(t, d, prompt, k, sampling, length, rule=rule)
    assert lengths == {0, 1, 2}
    tv = total_variation(got, exact)
    # The policy drafts less often than k every cycle, so a broken rule moves the law less (TV 0.0015 to 0.3
    # here); the exact law still tells it from the real rule's (below 1e-9) by six orders.
    assert tv < 1e-9 if variant is None else tv > 1e-3, f"{plug.name}: TV {tv:.3g}"


# ---------------------------------------------------------------- the pieces of the check


@pytest.fixture(scope="module")
def markov():
    """(target, draft) trigram pair over 6 tokens: the check's statistical test bed."""
    return markov_pair(6, seed=0)


@pytest.mark.parametrize("sampling, n", [(Sampling(1.0), 5000), (Sampling(0.7, top_p=0.9), 1000), (Sampling(1.0), 300)])
def test_partition_is_a_partition_with_large_cells(markov, sampling, n):
    """Cells cover every sequence once, their probabilities are the law's, and
    each expects at least min_expected samples, also after the pooled cell is
    merged into another (the second case does that)."""
    target, _ = markov
    length = 4
    law = TargetLaw(target, PROMPT, sampling, set(), length)
    part = Partition.build(law, n, length)
    exact = target_law(law)
    mass = np.zeros(len(part.probs))
    for seq, prob in exact.items():
        mass[part.cell(seq)] += prob
    assert np.abs(mass - part.probs).max() < 1e-12 and abs(part.probs.sum() - 1) < 1e-12
    assert (n * part.probs >= 20).all() and len(part.probs) > 5
    again = Partition.build(TargetLaw(target, PROMPT, sampling, set(), length), n, length)
    assert again.labels == part.labels  # a function of the law alone


def test_partition_merges_a_small_pool():
    """The pooled cell short of min_expected goes into the smallest cell (here: not the last one)."""
    target, _ = markov_pair(6, seed=0)
    law = TargetLaw(target, PROMPT, Sampling(0.7, top_p=0.9), set(), 4)
    part = Partition.build(law, 1000, 4)
    merged = [i for i, (prefix, kind) in enumerate(part.labels) if kind == "pool"]
    assert len(merged) == 1 and part.labels[merged[0]][0] != () and merged[0] < len(part.probs) - 1


def test_partition_of_a_long_near_deterministic_continuation():
    """exactness.length far past Python's recursion limit: a law that almost always repeats one token
    expands one node per position, 1500 deep. The partition still covers the law."""

    class Repeating:  # the law's two methods Partition reads
        def row(self, prefix):
            return np.array([1 - 1e-5, 0.5e-5, 0.5e-5])

        def terminal(self, prefix):
            return len(prefix) >= 1500

    part = Partition.build(Repeating(), 10_000, 1500)
    assert part.labels[0] == ((0,) * 1500, "seq") and part.probs[0] == pytest.approx((1 - 1e-5) ** 1500)
    assert part.labels[1] == ((), "pool") and part.probs.sum() == pytest.approx(1.0)
    assert part.cell((0,) * 1500) == 0 and part.cell((0, 1)) == part.cell((0,) * 700 + (2,)) == 1


def test_power_and_sizing_agree_with_the_noncentral_chi_square():
    from scipy import stats

    n, df, level = 10_000, 40, 1e-5
    tv = detectable_tv(n, df, level)
    # A shift of TV d along the direction that minimises the noncentrality has lambda = 4 n d^2.
    assert stats.ncx2.sf(stats.chi2.isf(level, df), df, 4 * n * tv**2) == pytest.approx(0.8, abs=1e-6)
    assert samples_for_tv(tv, df, level) in (n, n + 1)
    assert detectable_tv(4 * n, df, level) == pytest.approx(tv / 2)


@pytest.mark.parametrize("delta", [0.0, 0.08, 0.3])
def test_tv_upper_bound_covers_the_true_tv(delta):
    """The 95% upper bound on the cell-level TV covers the true TV in at least
    93% of 400 seeded draws (64 cells, N = 6,000, as on the default pair), for
    an exact sampler and for samplers off by a TV of 0.04 and 0.15 in the
    direction where TV <= sqrt(lambda / 4N) is tightest: r = pi (1 + delta s),
    s = +1 on half the mass and -1 on the rest. A bound too small by sqrt(2)
    covers 36% and 0% of the time there. For the exact sampler the bound is
    also informative (median below 0.05)."""
    from harness.exactness.stats import tv_upper_bound

    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.full(64, 2.0))  # [C] pi
    sign = np.where(np.cumsum(probs) <= 0.5, 1.0, -1.0)  # [C]
    law = probs * (1 + delta * sign)  # [C] r
    law /= law.sum()
    true_tv = 0.5 * np.abs(law - probs).sum() if delta else 0.0
    bounds = []
    for _ in range(400):
        counts = rng.multinomial(6000, law).astype(float)
        statistic, df, _ = g_test(counts, probs)
        bounds.append(tv_upper_bound(statistic, df, 6000))
    assert np.mean(np.array(bounds) >= true_tv) >= 0.93
    if not delta:
        assert np.median(bounds) < 0.05


def test_report_notes_a_prompt_whose_continuations_hardly_vary(markov):
    target, draft = markov
    report = check(target, ModelDrafter(draft), [("prompt", PROMPT)], k=1, sampling=Sampling(1.0), length=3, samples=2000)
    assert report["prompts"]["prompt"]["tests"]["joint"]["cells"] >= 8 and "note:" not in format_report(report)
    report["prompts"]["prompt"]["tests"]["joint"]["cells"] = 3
    assert "note: prompt: fewer than 8 joint cells" in format_report(report)


def test_holm_and_g_test():
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    statistic, df, p = g_test(np.array([30.0, 70.0]), np.array([0.3, 0.7]))
    assert (statistic, df, p) == (pytest.approx(0.0), 1, pytest.approx(1.0))
    assert g_test(np.array([10.0]), np.array([1.0]))[1:] == (0, 1.0)


def test_impossible_samples_fail_outright(markov):
    """The target without top-k: drafts the real target could never produce."""
    target, draft = markov
    variant = next(v for v in BROKEN if v.name == "target_without_top_p")
    with plugged(variant, target, ModelDrafter(draft)) as (t, d, _):
        report = check(t, d, [("p", PROMPT)], k=2, sampling=Sampling(1.0, top_k=2), length=4, samples=300, law_target=target)
    result = report["prompts"]["p"]
    assert result["zero_probability_samples"] > 0 and result["tests"]["joint"]["p_value"] == 0.0
    assert report["testable"] and report["family_p"] < report["alpha"] and not report["passed"]
    assert "rerun with dtype=float32" not in format_report(report)  # float32: no rounding excuse
    report["conditions"] = {"dtype": "bfloat16"}  # where chunked passes can round a truncation edge apart
    assert "rerun with dtype=float32 to tell rounding from a sampler bug" in format_report(report)
    # Too few draws for any cell to split (df 0 everywhere), yet an impossible draw is a verdict: FAIL.
    with plugged(variant, target, ModelDrafter(draft)) as (t, d, _):
        few = check(t, d, [("p", PROMPT)], k=2, sampling=Sampling(1.0, top_k=2), length=4, samples=20, law_target=target)
    assert few["prompts"]["p"]["zero_probability_samples"] > 0 and all(
        r["df"] == 0 for r in few["prompts"]["p"]["tests"].values()
    )
    assert few["testable"] and few["family_p"] < few["alpha"] and not few["passed"]
    assert "FAIL: exactness rejected" in format_report(few)


def test_long_continuations_are_not_impossible_by_underflow():
    """A 450-token continuation of a near-uniform target has probability about e^-806, which is 0
    in float64; every factor is above 0.1, so the draws are possible and a correct loop passes."""
    target, draft = markov_pair(6, seed=0, scale=0.1, draft_noise=0.1)
    prompt = torch.tensor([1, 2, 3])
    report = check(target, ModelDrafter(draft), [("p", prompt)], k=2, sampling=Sampling(1.0), length=450, samples=40)
    result = report["prompts"]["p"]
    # 40 draws of 450 tokens: one cell (no verdict), but nothing impossible, so nothing rejects
    assert result["zero_probability_samples"] == 0 and report["family_p"] == 1.0, format_report(report)
    law = TargetLaw(target, prompt, Sampling(1.0), set(), 450)
    (draw,) = draw_continuations(target, ModelDrafter(draft), prompt, 2, Sampling(1.0), 450, set(), 1, 0)
    factors = [float(law.row(draw.tokens[:i])[t]) for i, t in enumerate(draw.tokens)]
    assert math.prod(factors) == 0.0 and min(factors) > 0.05  # the premise: the product underflows


# ---------------------------------------------------------------- the check, by sampling
#
# Seeded, so deterministic. The real loop must pass over the whole grid at a
# family-wise level of 1e-4 (Bonferroni over the grid, Holm inside each
# check); every broken variant must fail with p < 1e-9 at the same N, and
# every lossless control must pass. The default suite runs N = 20,000;
# `-m slow` runs the same tests again at N = 50,000. FAMILY_ALPHA (conftest): 1e-4.

GRID = [(k, t, top_p) for k in (1, 2, 4) for t in (0.7, 1.0) for top_p in (1.0, 0.9)]
PER_CHECK_ALPHA = FAMILY_ALPHA / len(GRID)
SIZES = [pytest.param(20_000, id="N20k"), pytest.param(50_000, id="N50k", marks=pytest.mark.slow)]
VARIANT_K = 1  # variants run at k=1, T=0.7, and top-p 0.9 when the bug needs truncation: grid points


def variant_sampling(variant) -> Sampling:
    return Sampling(0.7, top_p=0.9) if variant.truncating else Sampling(0.7)


# The default suite runs half the grid, each k once with and once without top-p and each temperature at
# every k but one: CI's time on a 2-core machine (the other six run with -m slow; alpha stays over all 12).
DEFAULT_GRID = {(1, 0.7, 0.9), (1, 1.0, 1.0), (2, 0.7, 1.0), (2, 1.0, 0.9), (4, 0.7, 1.0), (4, 1.0, 0.9)}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    "k, temperature, top_p", [pytest.param(*point, marks=() if point in DEFAULT_GRID else pytest.mark.slow) for point in GRID]
)
def test_real_loop_passes_the_check(markov, k, temperature, top_p, n):
    target, draft = markov
    report = check(
        target,
        ModelDrafter(draft),
        [("prompt", PROMPT)],
        k=k,
        sampling=Sampling(temperature, top_p=top_p),
        length=k + 2,
        samples=n,
        seed=GRID.index((k, temperature, top_p)),
        alpha=PER_CHECK_ALPHA,
    )
    assert report["passed"], format_report(report)
    assert report["prompts"]["prompt"]["zero_probability_samples"] == 0


# Which of the check's tests must reject each broken variant on its own (p < 1e-9 before Holm),
# so that every test, not only the joint one, is shown to fail on a broken sampler. Measured at
# N = 20,000, k = 1: the first-token test caught these with p <= 1e-66 (0 for most), the bonus
# test its three with p <= 1e-56; a bug that leaves the first token's law alone (bonus, rollback)
# is the joint test's to catch.
CAUGHT_BY = {
    "accept_all": {"joint", "first"},
    "resample_from_p": {"joint", "first"},
    "ratio_q_over_p": {"joint", "first"},
    "residual_abs": {"joint", "first"},
    "unshaped_draft_q": {"joint", "first"},
    "target_without_top_p": {"joint", "first", "bonus"},
    "bonus_from_draft": {"joint", "bonus"},
    "bonus_wrong_row": {"joint", "bonus"},
    "target_row_off_by_one": {"joint", "first"},
    "no_rollback": {"joint"},
    "peeking_length": {"joint", "first"},
}


def test_every_test_of_the_check_catches_some_broken_variant():
    assert set(CAUGHT_BY) == {v.name for v in BROKEN}
    assert set().union(*CAUGHT_BY.values()) == set(TESTS)


def check_variant(markov, variant, n: int) -> dict:
    """The check on the trigram pair with `variant` plugged into the real loop, at N = n."""
    target, draft = markov
    with plugged(variant, target, ModelDrafter(draft)) as (t, d, rule):
        return check(
            t,
            d,
            [("prompt", PROMPT)],
            k=VARIANT_K,
            sampling=variant_sampling(variant),
            length=VARIANT_K + 2,
            samples=n,
            alpha=PER_CHECK_ALPHA,
            rule=rule or verify_rows,
            law_target=target,
        )


def verdict(report: dict) -> str:
    return "pass" if report["passed"] else "REJECTED" if report["testable"] else "NO VERDICT"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_check_rejects_broken_variants_and_keeps_lossless_ones(markov, variant, n):
    report = check_variant(markov, variant, n)
    if variant.lossless:
        assert report["passed"], format_report(report)
    else:
        assert report["testable"] and report["family_p"] < 1e-9, format_report(report)
        tests = report["prompts"]["prompt"]["tests"]
        for test in CAUGHT_BY[variant.name]:
            assert tests[test]["p_value"] < 1e-9, f"{variant.name}: the {test} test alone gave p = {tests[test]['p_value']:.3g}"


# The smallest round N at which the check rejects every broken variant at the grid's per-check level
# (at N = 1,000 unshaped_draft_q still passes, p = 0.01; at 2,000 its p is 4e-7): the table's N.
TABLE_N = 2000


def test_variant_table(markov, capsys):
    """Every variant's Holm-corrected p-value and verdict at N = TABLE_N, as a table (run with -s to see
    it): every broken variant is REJECTED, every lossless control passes."""
    rows = []
    for variant in VARIANTS:
        report = check_variant(markov, variant, TABLE_N)
        rows.append((variant.name, report["family_p"], verdict(report)))
    with capsys.disabled():
        print(f"\nexactness check on the variants, N={TABLE_N}, k={VARIANT_K}, T=0.7:\n" + variant_table(rows))
    assert {name for name, _, v in rows if v == "REJECTED"} == {v.name for v in BROKEN}
    assert {name for name, _, v in rows if v == "pass"} == {v.name for v in LOSSLESS}


# ---------------------------------------------------------------- the real tiny transformer pair, and the CLI


def test_check_passes_on_tiny_transformer_pair(tiny_pair, tmp_path):
    cfg = compose_check(tiny_pair, tmp_path, *TINY_CHECK)
    report = run_check(cfg, quiet=True)
    assert report["passed"], format_report(report)
    assert report["length"] == TINY_LENGTH and report["samples"] == TINY_SAMPLES and report["prompts"]
    saved = json.loads((tmp_path / report["run_dir"].split("/")[-1] / "exactness.json").read_text())
    assert saved["family_p"] == report["family_p"] and saved["pair"] == "llama_7b_68m"
    assert run_check(cfg, quiet=True) == saved  # a finished check is read back, not redone


def test_missing_rollback_is_caught_on_tiny_transformer_pair(tiny_pair):
    """The real dynamic cache (DynamicCache with harness.models.kv_cache's layers), not rolled back:
    stale keys and shifted positions, at the N above."""
    report = missing_rollback_report(tiny_pair)
    assert report["testable"] and report["family_p"] < FAMILY_ALPHA, format_report(report)


def test_kept_prompt_draws_what_fresh_caches_draw(tiny_pair):
    """The check prefills each prompt once (PromptKept); with the same seeds it
    commits exactly the tokens that runs from empty caches commit."""
    from harness.exactness.law import PromptKept
    from harness.models.cached import CachedLM

    target, drafter, prompt = tiny_cached_pair(tiny_pair)
    kept = draw_continuations(target, drafter, prompt, TINY_K, TINY_SAMPLING, TINY_LENGTH, set(), 40, 0)
    assert isinstance(drafter.lm, CachedLM)  # unwrapped afterwards

    class Fresh:  # not a CachedLM: draw_continuations leaves it alone, so every reset empties the cache
        def __init__(self, lm):
            self.lm = lm

        def __getattr__(self, name):
            return getattr(self.lm, name)

    fresh = draw_continuations(
        Fresh(target), ModelDrafter(Fresh(drafter.lm)), prompt, TINY_K, TINY_SAMPLING, TINY_LENGTH, set(), 40, 0
    )
    assert kept == fresh
    assert len({d.tokens for d in kept}) > 10  # distinct continuations, not one replayed
    wrapped = PromptKept(target, prompt)
    wrapped.reset()
    wrapped.forward(prompt, num_logits=1)
    wrapped.reset()
    assert target.length == prompt.shape[0] - 1 and wrapped.prefill(prompt[:-1]) is None


def test_kept_prompt_of_a_sliding_window_model_draws_what_fresh_caches_draw():
    """Continuations that run past a sliding window leave a cache that cannot roll back to the
    prompt: each then starts from an empty cache, and draws the tokens fresh caches draw."""
    from harness.models.cached import CachedLM
    from tests.test_loop import ids_of, sliding_window_pair

    target, draft = sliding_window_pair(window=8)
    prompt = ids_of("Sliding window")  # 6 tokens: prompt and continuation run past the window
    length = 8

    def draws(target_lm, draft_lm):
        return draw_continuations(target_lm, ModelDrafter(draft_lm), prompt, 3, Sampling(1.0), length, set(), 30, 0)

    class Fresh:  # not a CachedLM: every reset empties the cache
        def __init__(self, lm):
            self.lm = lm

        def __getattr__(self, name):
            return getattr(self.lm, name)

    kept = draws(CachedLM(target, 98), CachedLM(draft, 98))
    assert kept == draws(Fresh(CachedLM(target, 98)), Fresh(CachedLM(draft, 98)))
    assert len({d.tokens for d in kept}) > 5


def exactness_cli(*args: str) -> subprocess.CompletedProcess:

    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "harness.exactness", *args],
        capture_output=True,
        text=True,
        cwd=CONF_DIR.parent,
        env=env,
        timeout=300,
    )


@pytest.mark.cli
def test_cli_end_to_end_on_tiny_pair(tiny_pair, tmp_path):
    out = exactness_cli(
        *exactness_args(tiny_pair, tmp_path, "k=1", "temperature=1.0", "exactness.samples=100", "exactness.num_prompts=1")
    )
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["passed"] and last["samples"] == 100 and last["length"] == 3
    assert "PASS" in out.stdout and (tmp_path / last["run_dir"].split("/")[-1] / "exactness.json").exists()


def test_cost_aware_lookup_is_checked_with_the_proposals_a_run_makes(tiny_pair, tmp_path):
    """The check arms lookup's draft_length=cost with measured c and v(n), as `python -m harness` does:
    otherwise it would check whole-match proposals instead."""
    from harness.runner.pair import loaded_pairs

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="exactness_check",
            overrides=[
                *exactness_args(tiny_pair, tmp_path)[:3],
                f"out_dir={tmp_path}",
                "device=cpu",
                "wandb.mode=disabled",
                "pair.draft.kind=ngram",
                "draft_length=cost",
                "k=2",
                "temperature=1.0",
                "exactness.samples=50",
                "exactness.num_prompts=1",
            ],
        )
    report = run_check(cfg, quiet=True)
    drafter = next(pair.drafter for pair in loaded_pairs.values())
    assert drafter.draft_length.name == "cost" and len(drafter.draft_length.v) == 3 and report["passed"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("temperature=0", "is greedy"),
        ("exactness.length=1", "exactness.length=1 must be an integer >= 2"),
        ("exactness.detect_tv=0", "exactness.detect_tv=0.0 must be in (0, 1)"),
        ("exactness.samples=5", "exactness.samples=5 must be an integer >= 20"),
        ("exactness.alpha=2.0", "exactness.alpha=2.0 must be in (0, 1)"),
        ("k=0", "k=0 must be a positive integer"),
        ("exactness.length=600", "exactness.length=600 leaves no room for a prompt in the pair's 512-token context"),
    ],
)
def test_bad_input_is_refused_before_any_work(tiny_pair, tmp_path, override, message):
    with pytest.raises(HarnessError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_check(compose_check(tiny_pair, tmp_path, "temperature=1.0", override), quiet=True)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.cli
def test_cli_bad_input_is_one_line_and_exit_2(tiny_pair, tmp_path):
    out = exactness_cli(*exactness_args(tiny_pair, tmp_path, "temperature=0"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("error:")] == [
        "error: temperature=0.0 is greedy: the exactness check tests a sampling law, set temperature > 0 (e.g. temperature=1.0)"
    ]
    out = exactness_cli(*exactness_args(tiny_pair, tmp_path, "exactness.num_promts=1"))  # a typo in the check's own section
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: unknown setting 'exactness.num_promts': did you mean exactness.num_prompts? "
        "exactness has alpha, detect_tv, length, max_cells, num_prompts, rows, samples"
    ]


@pytest.mark.cli
def test_a_multirun_runs_every_job_and_exits_with_the_worst_status(tiny_pair, tmp_path):
    """k=0 is bad input (2) and k=1 passes: the sweep goes on past the first, and exits 2."""
    out = exactness_cli(
        "-m",
        *exactness_args(
            tiny_pair,
            tmp_path,
            "k=0,1",
            "temperature=1.0",
            "exactness.samples=50",
            "exactness.num_prompts=1",
            f"hydra.sweep.dir={tmp_path}/sweep",
        ),
    )
    assert out.returncode == 2 and "error: k=0 must be a positive integer" in out.stderr and "PASS" in out.stdout, out.stderr
    assert "cells in" not in out.stdout and not (tmp_path / "sweep" / "aggregate.md").exists()  # no benchmark table


@pytest.mark.parametrize(
    "launcher, exits",
    [
        ("hydra._internal.core_plugins.basic_launcher.BasicLauncher", False),
        ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher", True),
    ],
)
def test_a_failed_job_exits_where_its_launcher_can_see_it(monkeypatch, launcher, exits):
    """In-process jobs (the basic launcher) record their status for the end; a submitit job runs in a
    process of its own, whose exit status is how the launcher learns it failed."""
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig

    import harness.exactness.main as exactness
    from harness.cli import callbacks

    monkeypatch.setattr(callbacks, "in_multirun", lambda: True)
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: SimpleNamespace(launcher=SimpleNamespace(_target_=launcher))))
    monkeypatch.setattr(exactness, "EXIT_CODES", [])
    if exits:
        with pytest.raises(SystemExit) as stop:
            exactness.end_job(1)
        assert stop.value.code == 1
    else:
        exactness.end_job(1)
        assert exactness.EXIT_CODES == [1]


def test_a_check_that_cannot_start_keeps_a_folder_it_did_not_make(tiny_pair, tmp_path, monkeypatch):
    """Its own empty folder goes; another process's check of the same cell may have made the folder
    and be loading its models, so that one stays."""
    import harness.exactness.main as exactness

    seen = []

    def dataset_gone(cfg):
        seen.extend(tmp_path.glob("exactness-*"))
        raise HarnessError("dataset gone")

    monkeypatch.setattr(exactness, "chosen_prompts", dataset_gone)
    with pytest.raises(HarnessError, match="dataset gone"):
        run_check(compose_check(tiny_pair, tmp_path, "temperature=1.0"), quiet=True)
    assert len(seen) == 1 and not seen[0].exists()
    seen[0].mkdir()  # made by another process first
    with pytest.raises(HarnessError, match="dataset gone"):
        run_check(compose_check(tiny_pair, tmp_path, "temperature=1.0"), quiet=True)
    assert seen[0].is_dir()


@pytest.mark.cli
def test_a_check_that_crashes_exits_3_not_1(tiny_pair, tmp_path):
    """Exit 1 means "not exact": a broken model is no verdict."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pair["target"], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "vocab_size": "x"}))  # transformers raises a TypeError
    out = exactness_cli(
        *exactness_args(tiny_pair, tmp_path, "temperature=1.0", "exactness.samples=50"), f"pair.target.id={broken}"
    )
    assert out.returncode == 3, out.stderr
    assert "Traceback" in out.stderr and "error: the check itself failed (traceback above): no verdict" in out.stderr


def test_prompts_that_do_not_fit_are_skipped_as_the_benchmark_skips_them(tiny_pair, tmp_path):
    """prompts.overlong=skip is honoured (the check truncated every prompt), and a budget none fits is one line."""
    from harness.exactness.main import encode_prompts
    from harness.runner.pair import load_pair

    cfg = compose_check(tiny_pair, tmp_path, "temperature=1.0", "prompts.overlong=skip")
    pair = load_pair(cfg.pair, torch.device("cpu"), cfg.cache, cfg.compile, cfg.cpu_linear)
    prompts = [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 2000}]
    assert [pid for pid, _ in encode_prompts(cfg, pair, 8, prompts)] == ["short"]
    with pytest.raises(HarnessError, match="every chosen prompt is longer than the context budget"):
        encode_prompts(cfg, pair, 8, prompts[1:])
    cfg.prompts.overlong = "truncate"
    assert [pid for pid, _ in encode_prompts(cfg, pair, 8, prompts)] == ["short", "long"]


def test_the_sample_limit_holds_when_the_first_estimate_suffices(markov):
    """One cell (top-k 1: greedy in all but name) needs no second estimate: the limit holds for the first one too."""
    from harness.exactness.check import size_samples

    target, _ = markov
    with pytest.raises(HarnessError, match="needs over 1000 samples per prompt"):
        size_samples(
            target,
            [("prompt", PROMPT)],
            sampling=Sampling(1.0, top_k=1),
            length=4,
            eos_ids=set(),
            detect_tv=0.05,
            alpha=1e-3,
            limit=1000,
        )


def test_a_dataset_problem_stops_the_check_before_a_model_loads(tmp_path, monkeypatch):
    from test_config import composed

    import harness.exactness.main as exactness
    import harness.runner.pair as pair_module

    def no_model(*args, **kwargs):
        raise AssertionError("the pair loaded before the prompts")

    monkeypatch.setattr(pair_module, "load_pair", no_model)  # run_check imports it from there when it loads
    cfg = composed(["dataset=local", f"dataset.path={tmp_path / 'moved.jsonl'}", "temperature=1.0", f"out_dir={tmp_path}"])
    with pytest.raises(HarnessError, match="moved.jsonl does not exist"):
        exactness.run_check(cfg, quiet=True)


def test_samples_sized_from_detectable_tv(markov):
    from harness.exactness.check import size_samples

    target, _ = markov
    n = size_samples(target, [("prompt", PROMPT)], sampling=Sampling(1.0), length=4, eos_ids=set(), detect_tv=0.05, alpha=1e-3)
    law = TargetLaw(target, PROMPT, Sampling(1.0), set(), 4)
    df = len(Partition.build(law, n, 4, min_expected=max(20, n / 200)).probs) - 1
    assert detectable_tv(n, df, 1e-3 / 3) <= 0.05 < detectable_tv(int(n * 0.9), df, 1e-3 / 3)


@pytest.mark.parametrize("tv", [0.4, 0.5, 0.9])
def test_samples_sized_for_a_large_tv_split_the_continuations(markov, tv):
    """A TV of 0.4 or more needs only a handful of samples at one degree of freedom, too few for two
    cells of the minimum expected count: one cell, df 0, NO VERDICT. Sizing raises N until a cell
    splits (so N >= 40, above the floor of exactness.samples), then sizes for the df it gets."""
    from harness.exactness.check import size_samples
    from harness.exactness.law import MIN_EXPECTED, min_expected_for

    target, draft = markov
    n = size_samples(target, [("prompt", PROMPT)], sampling=Sampling(1.0), length=4, eos_ids=set(), detect_tv=tv, alpha=1e-3)
    law = TargetLaw(target, PROMPT, Sampling(1.0), set(), 4)

    def df(m):
        return len(Partition.build(law, m, 4, min_expected=min_expected_for(m, 200)).probs) - 1

    assert n >= 2 * MIN_EXPECTED and df(n) >= 1 and detectable_tv(n, df(n), 1e-3 / 3) <= tv
    assert df(n - 1) == 0 or detectable_tv(n - 1, df(n - 1), 1e-3 / 3) > tv  # the smallest such N
    report = check(target, ModelDrafter(draft), [("prompt", PROMPT)], k=1, sampling=Sampling(1.0), length=4, samples=n)
    assert report["testable"] and report["passed"], format_report(report)


def test_sizing_refuses_a_law_with_one_continuation(markov):
    """top_k=1: every N leaves one cell, so no N can test anything; that is an error, not an N (nor a NO VERDICT)."""
    from harness.exactness.check import size_samples

    target, _ = markov
    with pytest.raises(HarnessError, match="one continuation of every prompt: nothing to test"):
        size_samples(
            target, [("prompt", PROMPT)], sampling=Sampling(1.0, top_k=1), length=4, eos_ids=set(), detect_tv=0.05, alpha=1e-3
        )
    # T = 0.05: more than one continuation, but none other holds 1/max_cells of the mass, so no N gives two cells
    with pytest.raises(
        HarnessError, match="too concentrated for two cells of 1/200 of the mass each: .* raise exactness.max_cells"
    ):
        size_samples(target, [("prompt", PROMPT)], sampling=Sampling(0.05), length=4, eos_ids=set(), detect_tv=0.05, alpha=1e-3)


def test_a_check_sized_for_a_large_tv_gives_a_verdict(tiny_pair, tmp_path):
    """exactness.detect_tv=0.5, exactness.samples null: N is sized past the 20 whose single cell per test gives NO VERDICT (exit 2)."""
    cfg = compose_check(tiny_pair, tmp_path, "k=1", "temperature=1.0", "exactness.num_prompts=1", "exactness.detect_tv=0.5")
    report = run_check(cfg, quiet=True)
    assert report["testable"] and report["samples"] >= 40 and report["detect_tv_asked"] == 0.5, format_report(report)


def test_the_no_verdict_error_says_whether_samples_were_given_or_sized():
    from harness.exactness.check import no_verdict_error

    given = no_verdict_error({"samples": 20, "detect_tv_asked": None})
    assert given.startswith("every test has a single cell, so the check tested nothing: either exactness.samples=20 is too few")
    sized = no_verdict_error({"samples": 52, "detect_tv_asked": 0.5})
    assert "N=52, sized from exactness.detect_tv=0.5" in sized and "exactness.samples=52" not in sized
    assert "null to size it" not in sized and "\n" not in given + sized


# ---------------------------------------------------------------- the embedded 4-layer pair (slow: run it on a GPU)

_default_pair_samples: dict = {}

# Runs on the embedded 4-layer pair (`smollm2`) use k = 1: the single draft survives in about half
# the cycles, and every survival is followed by a bonus token, so bonus bugs
# move the law of the first tokens (at k = 4 with this draft all 4 drafts
# survive in ~5% of cycles). (k, temperature, top_p):
DEFAULT_SETTING = (1, 1.0, 1.0)
# A q that is not the law the draft sampled from, and a p without the draft's
# truncation, only differ from the correct ones when rows are shaped and cut.
SHAPED_SETTING = (1, 0.7, 0.9)
VARIANT_SETTING = {"unshaped_draft_q": SHAPED_SETTING, "target_without_top_p": SHAPED_SETTING}
REAL_LOOP_SETTINGS = sorted({DEFAULT_SETTING, *VARIANT_SETTING.values()}, reverse=True)


def _setting_id(setting):
    k, temperature, top_p = setting
    return f"k{k}-T{temperature:g}-p{top_p:g}"


DEFAULT_PAIR_RUNS = [pytest.param(None, s, id=f"real_loop-{_setting_id(s)}") for s in REAL_LOOP_SETTINGS] + [
    pytest.param(
        v,
        VARIANT_SETTING.get(v.name, DEFAULT_SETTING),
        id=f"{v.name}-{_setting_id(VARIANT_SETTING.get(v.name, DEFAULT_SETTING))}",
    )
    for v in VARIANTS
]


@pytest.mark.slow
@pytest.mark.parametrize("variant, setting", DEFAULT_PAIR_RUNS)
def test_default_pair_at_detectable_tv_005(variant, setting, capsys):
    """On the embedded 4-layer pair, with N sized to detect a TV of 0.05: the
    real loop passes, each broken variant fails, each lossless control passes.
    k = 1 and T = 1 unless the bug needs shaped rows to exist (above). The
    first builtin prompt, chat-templated as `python -m harness` sends it:
    about 10 minutes per run on 2 CPU cores."""
    import time

    from harness.config.checks import with_default_pair
    from harness.exactness.check import size_samples
    from harness.exactness.main import chosen_prompts, encode_prompts
    from harness.models.loading import resolve_device
    from harness.runner.pair import load_pair

    k, temperature, top_p = setting
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = with_default_pair(
            compose(
                config_name="exactness_check",
                overrides=[
                    "+pair=smollm2",
                    f"k={k}",
                    f"temperature={temperature}",
                    f"top_p={top_p}",
                    "cache=dynamic",
                    "exactness.num_prompts=1",
                ],
            )
        )
    try:
        pair = load_pair(cfg.pair, resolve_device(cfg.device))
    except HarnessError as err:
        pytest.skip(f"the embedded 4-layer pair is not available here: {err}")
    sampling = Sampling(temperature, top_p=top_p)
    length, alpha = k + 2, cfg.exactness.alpha
    prompts = encode_prompts(cfg, pair, length, chosen_prompts(cfg))
    if setting not in _default_pair_samples:
        _default_pair_samples[setting] = size_samples(
            pair.target, prompts, sampling=sampling, length=length, eos_ids=pair.eos_ids, detect_tv=0.05, alpha=alpha
        )
    n = _default_pair_samples[setting]
    plug = variant or broken.Variant("real_loop", True, "the real loop")
    start, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # a 135M-parameter model, unlike the module's tiny ones
    try:
        with plugged(plug, pair.target, pair.drafter) as (t, d, rule):
            report = check(
                t,
                d,
                prompts,
                k=k,
                sampling=sampling,
                length=length,
                samples=n,
                eos_ids=pair.eos_ids,
                alpha=alpha,
                rule=rule or verify_rows,
                law_target=pair.target,
                progress=True,
            )
    finally:
        torch.set_num_threads(threads)
    (result,) = report["prompts"].values()
    tests = {test: f"{r['p_value']:.3g} ({r['cells']} cells)" for test, r in result["tests"].items()}
    with capsys.disabled():
        print(
            f"\n{plug.name} {_setting_id(setting)}: N={n}, Holm p={report['family_p']:.3g}, "
            f"passed={report['passed']}, zero-prob={result['zero_probability_samples']}, {tests}, "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
    if variant is None or variant.lossless:
        assert report["passed"], format_report(report)
    else:
        assert report["testable"] and report["family_p"] < alpha, format_report(report)


@pytest.mark.parametrize(
    "overrides, device, checked_in",
    [
        (["top_p=0.9"], "cuda", "float32"),  # auto would be bfloat16: a truncated law is defined only up to rounding there
        (["top_k=50"], "cuda", "float32"),
        (["top_p=0.9", "dtype=bfloat16"], "cuda", "bfloat16"),  # asked for explicitly
        ([], "cuda", "auto"),  # no truncation: the zero-probability rule cannot meet rounding
        (["top_p=0.9"], "cpu", "auto"),  # auto is float32 on a CPU
    ],
)
def test_a_truncated_law_is_checked_in_full_precision_unless_asked(tiny_pair, tmp_path, overrides, device, checked_in):
    from harness.config.checks import with_default_pair
    from harness.exactness.main import full_precision_for_truncation

    cfg = with_default_pair(compose_check(tiny_pair, tmp_path, "temperature=1.0", *overrides))
    note = full_precision_for_truncation(cfg, torch.device(device))  # no GPU is touched: only the dtype auto resolves to
    assert cfg.dtype == checked_in and (note is not None) == (checked_in == "float32")
    if note:
        assert cfg.pair.target.dtype == cfg.pair.draft.dtype == "float32" and "checking in float32" in note


@pytest.mark.parametrize(
    "overrides, device, target, draft, top",
    [
        # a target pinned to bfloat16 stays there (the user's choice), and the note says so instead of "checking in float32"
        (["top_p=0.9", "pair.target.dtype=bfloat16"], "cuda", "bfloat16", "float32", "float32"),
        (["top_p=0.9", "pair.target.dtype=bfloat16", "pair.draft.dtype=bfloat16"], "cuda", "bfloat16", "bfloat16", "auto"),
        (["top_k=50", "pair.target.dtype=float16"], "cpu", "float16", "auto", "auto"),  # auto is float32 there: nothing to switch
        # a pinned draft stays too; its rounding is harmless (verify uses the rows it sampled from)
        (["top_k=50", "pair.draft.dtype=bfloat16"], "cuda", "float32", "bfloat16", "float32"),
    ],
)
def test_a_dtype_pinned_on_the_pair_is_kept_and_the_note_says_so(tiny_pair, tmp_path, overrides, device, target, draft, top):
    from harness.config.checks import with_default_pair
    from harness.exactness.main import full_precision_for_truncation

    cfg = with_default_pair(compose_check(tiny_pair, tmp_path, "temperature=1.0", *overrides))
    note = full_precision_for_truncation(cfg, torch.device(device))
    assert (cfg.pair.target.dtype, cfg.pair.draft.dtype, cfg.dtype) == (target, draft, top)
    assert note is not None and "checking in float32" not in note
    if target != "float32":
        assert f"pair.target.dtype={target} is pinned" in note and "may fail on rounding at the truncation edge" in note
        assert ("the draft is checked in float32" in note) == (draft == "float32")
    else:
        assert "checking the target in float32" in note and f"the draft stays in {draft}, pinned by pair.draft.dtype" in note


@pytest.mark.cli
def test_a_check_whose_every_test_has_one_cell_gives_no_verdict(tiny_pair, tmp_path):
    """20 samples: every cell's expected count would fall short, so each test is one cell (df 0) and could
    not reject anything. That is no pass: the report says NO VERDICT and the command exits 2."""
    out = exactness_cli(
        *exactness_args(tiny_pair, tmp_path, "k=1", "temperature=1.0", "exactness.samples=20", "exactness.num_prompts=1")
    )
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["testable"] is False and last["passed"] is False
    assert "NO VERDICT: every test has a single cell" in out.stdout and "PASS" not in out.stdout
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "error: every test has a single cell, so the check tested nothing: either exactness.samples=20 is too few"
    )
