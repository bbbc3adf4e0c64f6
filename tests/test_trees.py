"""Token trees through the one loop: the device rule draw for draw against the reference rule (exact by
enumeration in test_tree_rule.py), greedy output equal to the target's, the exact law of whole runs with
sampled and top-token trees, and a loop that keeps a rejected branch's cache caught."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from markov import markov_pair
from test_exactness import PROMPT, Branches, target_law, total_variation
from test_tree_rule import TreeEnum

import harness.core.rule
import harness.core.tree as tree
import harness.core.tree_shapes
from harness.core.drafters import ModelDrafter
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.sampling import Sampling, shape_probs
from harness.core.tree_shapes import TreeSpec, static_parents
from harness.exactness.law import TargetLaw

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("shape", [[3], [2, 1], [2, 2], [1, 3], [3, 2, 1], [4, 1]], ids=str)
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "one_hot"])
@pytest.mark.parametrize("form", ["host", "device"])  # the parents a host list, or kept on the device (more rounds)
def test_the_device_rule_draws_as_the_reference_rule(shape, sampled, form):
    """verify_tree_rows: the same path and next token as verify_tree from the same generator state, on 200
    random cases (some accepting nothing, some whole paths); greedy_tree_rows as greedy_tree. Parents kept on
    the device (a dynamic tree's) come with a bound on the rounds, not the widths: the same draws."""
    parents, V, reached = static_parents(shape), 5, set()
    given, rounds = (parents, shape) if form == "host" else (torch.tensor(parents), [max(shape) + 1] * len(shape))
    gen = torch.Generator().manual_seed(len(shape) * 10 + sampled)
    for case in range(200):
        p = torch.softmax(2 * torch.randn(len(parents) + 1, V, generator=gen), -1)
        q = torch.softmax(2 * torch.randn(len(parents), V, generator=gen), -1)
        tokens = torch.multinomial(q, 1, generator=gen)[:, 0] if sampled else torch.randint(0, V, (len(parents),), generator=gen)
        law = q if sampled else None
        ref = tree.verify_tree(tokens, parents, law, p, torch.Generator().manual_seed(case))
        got = tree.verify_tree_rows(tokens, given, rounds, law, p, torch.Generator().manual_seed(case))
        assert [n for n in got.path.tolist() if n >= 0] == ref.path and int(got.accepted) == len(ref.path)
        assert int(got.next_token) == int(ref.next_token)
        reached.add(len(ref.path))
        argmax = p.argmax(-1)
        argmax[case % (len(parents) + 1)] = tokens[case % len(parents)]  # some cases follow a node
        ref, got = tree.greedy_tree(tokens, parents, argmax), tree.greedy_tree_rows(tokens, given, rounds, argmax)
        assert [n for n in got.path.tolist() if n >= 0] == ref.path and int(got.next_token) == int(ref.next_token)
    assert {0, len(shape)} <= reached, reached


def reference_cycle(tokens, parents, widths, q, scored, sampling, generator):
    """The loop's tree rule as the reference verify_tree (host walk), in the device rule's form."""
    parents = parents.tolist() if isinstance(parents, torch.Tensor) else parents  # a dynamic tree's, read here
    if sampling.greedy:
        verdict = tree.greedy_tree(tokens, parents, scored.argmax(-1))
    else:
        verdict = tree.verify_tree(tokens, parents, q, shape_probs(scored, sampling), generator)
    path = torch.tensor(verdict.path + [-1] * (len(widths) - len(verdict.path)), dtype=torch.long)
    return tree.TreeVerdicts(torch.tensor(len(verdict.path)), path, torch.as_tensor(verdict.next_token))


class LoopEnum(TreeEnum):
    """TreeEnum over whole runs: the tree's sampled candidates, the rule's uniforms and draws, and the chain
    rule's draws of a cycle that drafts nothing (the last one)."""

    def sample_rows(self, weights, generators):
        return torch.stack([torch.tensor(self.branches.choose((w.double() / w.double().sum()).tolist())) for w in weights])

    @contextmanager
    def installed(self):
        with super().installed():
            saved = [(m, m.sample_rows) for m in (harness.core.tree_shapes, harness.core.rule)]
            for m, _ in saved:
                m.sample_rows = self.sample_rows
            try:
                yield
            finally:
                for m, value in saved:
                    m.sample_rows = value

    def law(self, run) -> dict:
        law, stack = {}, [[]]
        with self.installed():
            while stack:
                self.branches = Branches(stack.pop())
                outcome = run()
                law[outcome] = law.get(outcome, 0.0) + self.branches.weight
                stack += self.branches.forks
        return law


def tree_loop_law(shape, candidates: str, k: int, length: int, target, drafter, **loop) -> dict:
    drafter.tree = TreeSpec(tuple(shape), sampled=candidates == "sampled")
    sampling = Sampling(1.0)

    def run():
        cycles = speculative_decode(
            target, drafter, PROMPT, k, sampling, length, set(), torch.Generator(), tree_rule=reference_cycle, **loop
        )
        return tuple(t for c in cycles for t in c.tokens)

    return LoopEnum().law(run)


TREE_RUNS = {  # (shape, candidates, tokens): sampled trees branch on every draw, so their runs are shorter
    "[2,1] top": ([2, 1], "top", 4),
    "[2,2] top": ([2, 2], "top", 4),
    "[1,1] sampled": ([1, 1], "sampled", 3),
    "[2,1] sampled": ([2, 1], "sampled", 3),
}


@pytest.mark.parametrize("case", TREE_RUNS)
def test_tree_runs_keep_the_target_law_exactly(case):
    """Whole runs of the loop with trees (drafting, one verify pass with the tree's mask, compaction of both
    caches, the next cycle): the law of the committed tokens is the target's, every branch enumerated."""
    shape, candidates, length = TREE_RUNS[case]
    target, draft = markov_pair(4, seed=0)
    exact = target_law(TargetLaw(target, PROMPT, Sampling(1.0), set(), length))
    got = tree_loop_law(shape, candidates, len(shape), length, target, ModelDrafter(draft))
    assert abs(sum(got.values()) - 1) < 1e-12
    assert total_variation(got, exact) < 1e-9


class KeepsRejectedBranch:
    """A target whose cache is never compacted: after a tree, the accepted path's slots hold the first nodes drafted."""

    def __init__(self, lm):
        self.lm = lm

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def compact(self, base, kept) -> None:
        pass


def test_a_loop_that_keeps_a_rejected_branch_cache_is_caught_exactly():
    target, draft = markov_pair(4, seed=0)
    length = 4
    exact = target_law(TargetLaw(target, PROMPT, Sampling(1.0), set(), length))
    got = tree_loop_law([3, 1], "top", 2, length, KeepsRejectedBranch(target), ModelDrafter(draft))
    assert total_variation(got, exact) > 1e-2


@pytest.mark.parametrize("shape", [[2, 1], [3, 2, 1], [2, 2], [1, 1, 1]], ids=str)
def test_tree_runs_keep_greedy_output(shape):
    target, draft = markov_pair(6, seed=3, draft_noise=2.0)
    drafter = ModelDrafter(draft)
    drafter.tree = TreeSpec(tuple(shape))
    for prompt in ([1, 2], [3, 0, 5], [4, 4]):
        ids = torch.tensor(prompt)
        alone = list(autoregressive_decode(target, ids, Sampling(0.0), 12, set(), None))
        cycles = list(speculative_decode(target, drafter, ids, len(shape), Sampling(0.0), 12, set(), None))
        assert [t for c in cycles for t in c.tokens] == alone
        assert max(c.num_accepted for c in cycles) >= 1


def test_dynamic_tree_runs_keep_the_target_law_and_greedy_output():
    """EAGLE-2's dynamic tree (the draft's best candidates by path probability, one-hot): exact at T=1, whole runs
    enumerated, and greedy output equal to the target's."""
    target, draft = markov_pair(4, seed=0)
    drafter, length = ModelDrafter(draft), 4
    exact = target_law(TargetLaw(target, PROMPT, Sampling(1.0), set(), length))
    drafter.tree = TreeSpec(nodes=4, topk=2)

    def run():
        cycles = speculative_decode(
            target, drafter, PROMPT, 3, Sampling(1.0), length, set(), torch.Generator(), tree_rule=reference_cycle
        )
        return tuple(t for c in cycles for t in c.tokens)

    assert total_variation(LoopEnum().law(run), exact) < 1e-9
    target, draft = markov_pair(6, seed=3, draft_noise=2.0)
    drafter = ModelDrafter(draft)
    drafter.tree = TreeSpec(nodes=6, topk=3)
    for prompt in ([1, 2], [3, 0, 5], [4, 4]):
        ids = torch.tensor(prompt)
        alone = list(autoregressive_decode(target, ids, Sampling(0.0), 12, set(), None))
        cycles = list(speculative_decode(target, drafter, ids, 3, Sampling(0.0), 12, set(), None))
        assert [t for c in cycles for t in c.tokens] == alone
        assert all(c.nodes <= 6 for c in cycles) and max(c.num_accepted for c in cycles) >= 1


def test_a_dynamic_tree_keeps_the_best_candidates_with_their_parents():
    """The kept nodes are the `nodes` best by summed log-probability, every parent kept before its children; the
    structure stays on the device, and the fed nodes' slots are where each was fed."""
    from harness.core.tree_shapes import grow

    V, gen = 6, torch.Generator().manual_seed(1)
    tables = torch.randn(V, V, generator=gen)  # the draft's logits after a token
    root = torch.randn(1, V, generator=gen)
    fed = []

    def expand(first, tokens, tree):
        assert len(tree) == first + tokens.shape[0]
        fed.extend(tokens.tolist())
        return tables[tokens]

    tokens, q, shape = grow(TreeSpec(nodes=7, topk=3), 3, root, expand, Sampling(0.0), None)
    assert isinstance(shape.parents, torch.Tensor) and isinstance(shape.slots, torch.Tensor)
    parents, slots = shape.parents.tolist(), shape.slots.tolist()
    assert q is None and len(parents) == 7 and tokens.shape == (7,) and shape.widths == [3, 3, 3]
    assert all(p < i for i, p in enumerate(parents))
    assert all(s < 0 or fed[s] == int(tokens[i]) for i, s in enumerate(slots)) and len(fed) == 6  # 3 + 3 fed
    assert all(slots[p] >= 0 for p in parents if p >= 0)  # a kept node's parent was fed
    logp = lambda logits, t: float(torch.log_softmax(logits, -1)[t])  # noqa: E731
    score = []
    for i, p in enumerate(parents):
        above = root[0] if p < 0 else tables[tokens[p]]
        score.append((0.0 if p < 0 else score[p]) + logp(above, int(tokens[i])))
    level1 = torch.log_softmax(root[0], -1).topk(3).values.tolist()
    assert sorted(s for s, p in zip(score, parents) if p < 0) == pytest.approx(sorted(level1)[-sum(p < 0 for p in parents) :])
    top = torch.log_softmax(root[0], -1).topk(3)
    second = [
        s + float(v)
        for s, t in zip(top.values.tolist(), top.indices.tolist())
        for v in torch.log_softmax(tables[t], -1).topk(3).values
    ]
    assert min(score) >= sorted(level1 + second)[-7] - 1e-6  # the kept are the best 7 of all, these among them
