"""Token trees fed in one forward (KVStore.step's `tree`, the backends' `tree`) and the compaction of the accepted
path: every node's logits are those of its path fed as a plain chain."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import LlamaForCausalLM

from harness.errors import HarnessError
from harness.models.batched import LeanBatch, OneRow
from harness.models.cached import CachedLM
from harness.models.kv_store import DeviceTree, ancestry, tree_layout
from tests.test_loop import sliding_window_pair

VOCAB = 50
PROMPT = torch.tensor([5, 9, 14, 3, 27, 8, 41])
BRANCHING = [-1, 0, 0, 1, 1, 2, 2]  # a root, 2 children, 4 grandchildren (breadth first)
ROOTS = [-1, -1, 0, 0, 1, 1]  # two first-level nodes
TOKENS = torch.tensor([11, 12, 13, 21, 22, 23, 24])
BACKENDS = [("lean", "sdpa"), ("hf", "sdpa"), ("hf", "eager")]


def llama(attention: str) -> LlamaForCausalLM:
    model = tiny_model(LlamaForCausalLM, VOCAB, seed=4, max_position_embeddings=256, attn_implementation=attention)
    return model.double()  # float64: the tree's logits and the chain's agree to rounding


def path(tree: list[int], node: int) -> list[int]:
    """The node's ancestors and itself, root first."""
    return path(tree, tree[node]) + [node] if node >= 0 else []


@torch.inference_mode()
def chain_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits [V] of a fresh forward over ids."""
    return model(input_ids=ids[None]).logits[0, -1]


def make(forward: str, attention: str) -> CachedLM:
    return CachedLM(llama(attention), VOCAB, forward=forward, max_len=64)


def test_layout_of_a_chain_is_the_causal_step():
    positions, mask = tree_layout([-1, 0, 1, 2, 3], 7, 3, torch.device("cpu"))  # the last 3 of 5 chain slots after 7
    assert positions.tolist() == [7, 8, 9]
    assert torch.equal(mask, torch.arange(10) <= positions[:, None])


def test_layout_of_a_tree():
    positions, mask = tree_layout(ROOTS, 4, 4, torch.device("cpu"))  # slots 2..5 of the tree, fed after 2 of it (base 2)
    assert positions.tolist() == [3, 3, 3, 3]  # all at depth 2: base + 1
    tree_part = [[1, 0, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 0, 1]]
    assert mask.tolist() == [[True, True] + [bool(b) for b in row] for row in tree_part]


def brute_layout(tree: list[int], start: int, width: int) -> tuple[list[int], list[list[bool]]]:
    """tree_layout by its definition: each fed slot at the position of its depth, seeing the slots before the
    tree, its ancestors and itself."""
    n = len(tree)
    base = start + width - n
    fed = range(n - width, n)
    return [base + len(path(tree, j)) - 1 for j in fed], [
        [a < base or a - base in path(tree, j) for a in range(start + width)] for j in fed
    ]


def test_layouts_of_random_trees_host_and_device_are_the_definitions():
    """3,000 random trees (a leading chain of 0-4 slots, then nodes; any number of the last slots fed): the
    host's layout and a DeviceTree's (its structure on the device) are brute_layout's."""
    gen, cpu = torch.Generator().manual_seed(0), torch.device("cpu")
    pick = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=gen))  # noqa: E731
    for _ in range(3000):
        chain, N = pick(0, 4), pick(1, 9)
        nodes = [pick(-1, i - 1) for i in range(N)]
        tree = list(range(-1, chain - 1)) + [chain + p if p >= 0 else chain - 1 for p in nodes]
        width = pick(1, len(tree))
        start = pick(len(tree) - width + (chain == 0), 12)  # a chainless tree hangs below a cached slot
        positions, mask = brute_layout(tree, start, width)
        for got in (tree_layout(tree, start, width, cpu), tree_layout(DeviceTree(chain, torch.tensor(nodes)), start, width, cpu)):
            assert got[0].tolist() == positions and got[1].tolist() == mask, (tree, start, width)


def test_ancestry_spans_the_deepest_path():
    """A chain of 9 nodes: each sees every node above it (fewer squarings would stop short)."""
    assert torch.equal(ancestry(torch.arange(-1, 8)), torch.ones(9, 9, dtype=torch.bool).tril())


@pytest.mark.parametrize("forward, attention", BACKENDS)
@pytest.mark.parametrize("tree", [BRANCHING, ROOTS])
@pytest.mark.parametrize(
    "first", [None, 1, 3, 5]
)  # None: the whole tree in one forward; else the first `first` nodes, then the rest
@pytest.mark.parametrize("form", ["host", "device"])  # the parents a host list, or a DeviceTree
def test_every_node_has_the_logits_of_its_path_as_a_chain(forward, attention, tree, first, form):
    lm = make(forward, attention)
    tokens = TOKENS[: len(tree)]
    lm.forward(PROMPT)
    given = (lambda nodes: nodes) if form == "host" else (lambda nodes: DeviceTree(0, torch.tensor(nodes)))
    if first is None:
        logits = lm.forward(tokens, num_logits=len(tree), tree=given(tree))
    else:
        head = lm.forward(tokens[:first], num_logits=first, tree=given(tree[:first]))
        logits = torch.cat([head, lm.forward(tokens[first:], num_logits=len(tree) - first, tree=given(tree))])
    assert lm.length == len(PROMPT) + len(tree)
    for node in range(len(tree)):
        expected = chain_logits(lm.model, torch.cat([PROMPT, tokens[path(tree, node)]]))
        torch.testing.assert_close(logits[node], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("forward, attention", BACKENDS)
def test_features_of_a_tree_are_those_of_each_path(forward, attention):
    lm = make(forward, attention)
    layers = (1, 2)  # the last layer's input and the final normed state
    lm.forward(PROMPT)
    _, features = lm.forward_features(TOKENS, 1, layers, tree=BRANCHING)  # [7, 2 * hidden]
    for node in range(len(BRANCHING)):
        fresh = CachedLM(lm.model, VOCAB, forward="hf")
        _, expected = fresh.forward_features(torch.cat([PROMPT, TOKENS[path(BRANCHING, node)]]), 1, layers)
        torch.testing.assert_close(features[node], expected[-1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("forward, attention", BACKENDS)
def test_a_chain_tree_is_the_plain_step(forward, attention):
    def run(chain: list[int] | None) -> torch.Tensor:
        lm = make(forward, attention)
        lm.forward(PROMPT)
        lm.forward(TOKENS[:1], tree=chain and chain[:1])
        return lm.forward(TOKENS[1:5], num_logits=4, tree=chain)  # the last 4 of a chain of 5

    assert torch.equal(run(None), run([-1, 0, 1, 2, 3]))


@pytest.mark.parametrize("forward, attention", BACKENDS)
@pytest.mark.parametrize("kept", [[0, 2, 6], [0, 1, 4], [0, 1], [0], [1, 5]])
def test_compacted_path_goes_on_as_a_chain(forward, attention, kept):
    tree = BRANCHING if kept[0] == 0 else ROOTS
    lm = make(forward, attention)
    rows = OneRow(lm)
    rows.start(1)
    rows.forward([PROMPT], [1])
    base = lm.length
    rows.forward([TOKENS[: len(tree)]], [len(tree)], tree=[tree])
    assert path(tree, kept[-1]) == kept
    rows.compact([base], [kept])
    rows.rollback([base + len(kept)])
    (logits,) = rows.forward([torch.tensor([33, 34])], [2])
    ids = torch.cat([PROMPT, TOKENS[kept], torch.tensor([33, 34])])
    torch.testing.assert_close(logits[0], chain_logits(lm.model, ids[:-1]), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(logits[1], chain_logits(lm.model, ids), rtol=1e-9, atol=1e-9)


def test_static_cache_refuses_trees():
    lm = CachedLM(llama("sdpa"), VOCAB, cache="static", max_len=64)
    lm.forward(PROMPT)
    with pytest.raises(HarnessError, match="token trees run on cache=dynamic") as refused:
        lm.forward(TOKENS, num_logits=7, tree=BRANCHING)
    assert "\n" not in str(refused.value)
    with pytest.raises(HarnessError, match="cache=dynamic"):
        lm.forward_features(TOKENS, 1, (1,), tree=BRANCHING)
    with pytest.raises(HarnessError, match="cache=dynamic"):
        lm.compact(len(PROMPT), [0, 2])


def test_batch_forms_refuse_trees():
    rows = LeanBatch(make("lean", "sdpa"))
    rows.start(2)
    with pytest.raises(HarnessError, match="token trees run at batch_size=1") as refused:
        rows.forward([PROMPT, PROMPT], [1, 1], tree=[BRANCHING, None])
    assert "\n" not in str(refused.value)
    with pytest.raises(HarnessError, match="batch_size=1"):
        rows.compact([7, 7], [[0], [0]])
    rows.forward([PROMPT, PROMPT[:3]], [1, 1], tree=[None, None])  # no tree in any row: a plain step


def test_sliding_window_caches_refuse_trees():
    target, _ = sliding_window_pair(window=8)
    lm = CachedLM(target, target.config.vocab_size)
    lm.forward(PROMPT)
    with pytest.raises(HarnessError, match="drop `tree`") as refused:
        lm.forward(TOKENS, num_logits=7, tree=BRANCHING)
    assert "\n" not in str(refused.value) and "DynamicSlidingWindowLayer" in str(refused.value)
    assert lm.length == len(PROMPT)  # refused before the forward


def test_a_compiled_lean_forward_runs_trees_eagerly():
    lm, plain = make("lean", "sdpa"), make("lean", "sdpa")

    def captured(*args):
        raise AssertionError("a tree step ran captured")

    lm.lean.captured = captured  # compiled: steps after the prompt would run it
    for each in (lm, plain):
        each.forward(PROMPT[:1])  # the prompt runs eagerly
    assert torch.equal(lm.forward(TOKENS, 7, tree=BRANCHING), plain.forward(TOKENS, 7, tree=BRANCHING))
