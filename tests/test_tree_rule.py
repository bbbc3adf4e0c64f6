"""The rule over token trees (harness.core.tree), exactly: every branch of its draws enumerated with its
probability, the law of the committed tokens compared with the target's own, and broken rules rejected."""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import pytest
import torch
from test_exactness import Branches

import harness.core.tree as tree
from harness.core.tree_shapes import static_parents

V = 4
GEN = torch.Generator().manual_seed(0)
# The target's law after the root, and the draft's: the residual max(0, P0 - Q0) has two tokens, one of them
# (token 1) with r(x) / q(x) < 1, so that a rejected sibling's uniform, reused, changes the next one's odds.
P0 = torch.tensor([0.3, 0.5, 0.15, 0.05], dtype=torch.float64)
Q0 = torch.tensor([0.5, 0.42, 0.03, 0.05], dtype=torch.float64)
P = torch.softmax(2 * torch.randn(V, V, generator=GEN, dtype=torch.float64), -1)  # the target's after token a: P[a]
Q = torch.softmax(torch.log(P) + torch.randn(V, V, generator=GEN, dtype=torch.float64), -1)  # the draft's


class TreeEnum:
    """Every branch of a tree verdict's draws: drafted tokens, node uniforms as intervals (so a uniform
    used twice is conditioned on its first use), and the final token."""

    def __init__(self):
        self.branches: Branches | None = None

    def uniforms(self, n, generator, device):
        return [[0.0, 1.0] for _ in range(n)]

    def below(self, u, i, a) -> bool:
        lo, hi = u[i]
        cut = min(max(float(a), lo), hi)
        yes = self.branches.choose([(cut - lo) / (hi - lo), (hi - cut) / (hi - lo)]) == 0
        u[i][:] = [lo, cut] if yes else [cut, hi]
        return yes

    def sample_rows(self, weights, generators):
        w = weights[0].double()
        return torch.tensor([self.branches.choose((w / w.sum()).tolist())])

    def token(self, law) -> int:
        return self.branches.choose(law.tolist())

    @contextmanager
    def installed(self):
        saved = [(name, getattr(tree, name)) for name in ("uniforms", "below", "sample_rows")]
        tree.uniforms, tree.below, tree.sample_rows = self.uniforms, self.below, self.sample_rows
        try:
            yield
        finally:
            for name, value in saved:
                setattr(tree, name, value)


def tree_law(shape: list[int], sampled: bool, rule=None) -> dict:
    """{first two committed tokens: probability} of a cycle of `rule` on a drafted tree, the second token
    drawn from the target after the first where the cycle committed only one (as the next cycle would)."""
    enum, parents, law, stack = TreeEnum(), static_parents(shape), defaultdict(float), [[]]
    rule = rule or tree.verify_tree
    with enum.installed():
        while stack:
            enum.branches = Branches(stack.pop())
            tokens, q = [], []
            for parent in parents:  # drafted: sampled from the draft's law at the parent, or its top ones
                at = Q0 if parent < 0 else Q[tokens[parent]]
                if sampled:
                    tokens.append(enum.token(at))
                else:
                    rank = sum(1 for j in parents[: len(tokens)] if j == parent)
                    tokens.append(int(at.argsort(descending=True, stable=True)[rank]))
                q.append(at)
            p = torch.stack([P0] + [P[t] for t in tokens])  # [N + 1, V]
            verdict = rule(torch.tensor(tokens), parents, torch.stack(q) if sampled else None, p, None)
            committed = [tokens[i] for i in verdict.path] + [int(verdict.next_token)]
            if len(committed) == 1:
                committed.append(enum.token(P[committed[0]]))
            law[tuple(committed[:2])] += enum.branches.weight
            stack += enum.branches.forks
    return law


def target_law() -> dict:
    return {(a, b): float(P0[a] * P[a, b]) for a in range(V) for b in range(V)}


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in a.keys() | b.keys())


SHAPES = [[3], [2, 1], [2, 2], [1, 3]]


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "one_hot"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_tree_rule_keeps_the_target_law_exactly(shape, sampled):
    got = tree_law(shape, sampled)
    assert abs(sum(got.values()) - 1) < 1e-12
    assert total_variation(got, target_law()) < 1e-12


def no_renormalisation(*args):
    saved = tree.without
    tree.without = lambda r, q, x, one_hot: r  # a rejected sibling leaves the next one tested against p
    try:
        return tree.verify_tree(*args)
    finally:
        tree.without = saved


def largest_p_first(tokens, parents, q, p, generator):
    """Siblings tried in the order of the target's p of their token (a peek at the target)."""
    order = sorted(range(len(parents)), key=lambda i: (parents[i], -float(p[parents[i] + 1, int(tokens[i])])))
    order = sorted(order, key=lambda i: depth(parents, i))  # parents still before their children
    new = {old: n for n, old in enumerate(order)}
    verdict = tree.verify_tree(
        tokens[order],
        [new.get(parents[i], -1) for i in order],
        None if q is None else q[order],
        torch.cat([p[:1], p[1:][order]]),
        generator,
    )
    return tree.TreeVerdict([order[n] for n in verdict.path], verdict.next_token)


def depth(parents, i) -> int:
    return 0 if parents[i] < 0 else 1 + depth(parents, parents[i])


def first_uniform_reused(tokens, parents, q, p, generator):
    """Every sibling tested with its first sibling's uniform instead of its own."""
    first = {}
    for i, parent in enumerate(parents):
        first.setdefault(parent, i)
    saved = tree.uniforms
    tree.uniforms = lambda n, g, d: (lambda u: [u[first[parents[i]]] for i in range(n)])(saved(n, g, d))
    try:
        return tree.verify_tree(tokens, parents, q, p, generator)
    finally:
        tree.uniforms = saved


BROKEN = {
    "no_renormalisation": no_renormalisation,
    "largest_p_first": largest_p_first,
    "first_uniform_reused": first_uniform_reused,
}


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "one_hot"])
@pytest.mark.parametrize("bug", BROKEN)
def test_broken_tree_rules_are_caught_exactly(bug, sampled):
    if bug == "largest_p_first" and not sampled:
        pytest.skip("one-hot siblings are the draft's top tokens: reordering them by p is still exact (each test uses p alone)")
    got = tree_law([3], sampled, BROKEN[bug])
    assert abs(sum(got.values()) - 1) < 1e-12
    assert total_variation(got, target_law()) > 1e-3, bug


def test_greedy_follows_the_target_argmax_through_the_tree():
    parents = static_parents([2, 2])  # nodes 0, 1 at depth 1; 2, 3 below 0; 4, 5 below 1
    tokens = torch.tensor([1, 3, 0, 2, 2, 1])
    argmax = torch.tensor([3, 9, 1, 9, 9, 9, 0])  # after the root 3 (node 1), after node 1: 1 (node 5), after 5: 0
    verdict = tree.greedy_tree(tokens, parents, argmax)
    assert verdict.path == [1, 5] and int(verdict.next_token) == 0
    verdict = tree.greedy_tree(tokens, parents, torch.tensor([2, 9, 9, 9, 9, 9, 9]))  # no child is the argmax
    assert verdict.path == [] and int(verdict.next_token) == 2
