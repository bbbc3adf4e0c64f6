"""Token trees a drafter proposes (harness.core.tree verifies them): the shape, and how a level is drafted.

`tree=[3,2,1]` is a static tree: every node at depth d gets widths[d] children (breadth first, so a node's
index is its slot after the committed tokens and parents come first). Candidates are the draft's top tokens
(`one-hot`: deterministic, any temperature) or, at T > 0 with `tree_candidates=sampled`, drawn independently
per sibling from the draft's law at their parent (`q`, which the rule needs). The drafter feeds the nodes
level by level with a tree attention mask (harness.models.kv_store.tree_layout), never the last level.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.base.host_reads import from_host
from harness.core.sampling import Sampling, sample_rows, shape_probs
from harness.core.tree import sibling_ranks
from harness.models.kv_store import DeviceTree


@dataclass(frozen=True)
class TreeSpec:
    """A tree setting: static `widths`, or a dynamic tree (EAGLE-2) of `nodes` nodes from the `topk` best children
    of the `topk` best nodes per depth; candidates sampled or the draft's top tokens (a dynamic tree's: top)."""

    widths: tuple[int, ...] = ()
    sampled: bool = False
    nodes: int = 0  # a dynamic tree's node budget (static: its node count)
    topk: int = 4

    def __post_init__(self):
        if self.widths:
            object.__setattr__(self, "nodes", len(static_parents(self.widths)))

    @property
    def dynamic(self) -> bool:
        return not self.widths

    def describe(self) -> dict:
        shape = {"shape": "dynamic", "topk": self.topk} if self.dynamic else {"shape": list(self.widths)}
        return {**shape, "nodes": self.nodes, "candidates": "sampled" if self.sampled else "top"}


@dataclass
class TreeShape:
    """One proposal's tree, its structure on the device ([N] tensors: the host never reads it): node i's parent
    (-1: the last committed token) and where the drafter cached it (-1: not fed, a leaf); per depth the rule's
    rounds (host ints: at least the most children a node has there)."""

    parents: torch.Tensor
    widths: list[int]
    one_hot: bool  # candidates were the draft's top tokens: the rule takes no q
    slots: torch.Tensor

    def with_prefix(self, chain: int) -> DeviceTree:
        """A verify pass's fed slots: `chain` committed tokens (a chain), then the nodes below the last."""
        return DeviceTree(chain, self.parents)

    def path_facts(self, path: torch.Tensor) -> torch.Tensor:
        """[2, D] for the accepted nodes path [D] (-1 past its end: garbage there): where the drafter cached each
        (-1: not fed) and its place among its siblings (0: tried first). On the device, read with the verdict."""
        at = path.clamp(min=0)
        return torch.stack([self.slots[at], sibling_ranks(self.parents)[at]])


def static_parents(widths) -> list[int]:
    """Parents of a static tree, widths[d] children for every node at depth d, breadth first."""
    parents, level = [], [-1]
    for width in widths:
        nxt = []
        for node in level:
            for _ in range(width):
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


# (first fed, tokens [n], the fed nodes' tree: the parents of the first + n) -> logits [n, V]
Expand = Callable[[int, torch.Tensor, DeviceTree], torch.Tensor]


def grow(
    spec: TreeSpec, depth: int, root: torch.Tensor, expand: Expand, sampling: Sampling, generator
) -> tuple[torch.Tensor, torch.Tensor | None, TreeShape]:
    """Draft a tree of up to `depth` levels below the root's logits [1, V]; expand(first, tokens, tree) feeds a
    level's nodes (tree: the parents of every node fed so far, among the fed) and gives their logits.
    (tokens [N], q [N, V] or None, shape)."""
    if spec.dynamic:
        return grow_dynamic(spec, depth, root, expand)
    widths = list(spec.widths[:depth])
    parents = static_parents(widths)
    fed = len(parents) - math.prod(widths)  # every level but the last, breadth first: the first nodes
    known = from_host(parents + [i if i < fed else -1 for i in range(len(parents))], root.device)  # one copy
    parents, slots = known[: len(parents)], known[len(parents) :]  # [N] each
    one_hot = sampling.greedy or not spec.sampled
    logits, drafted, laws, first = root, [], [], 0
    for d, width in enumerate(widths):
        if one_hot:
            picked = logits.topk(width, dim=-1).indices.reshape(-1)  # [n * width] each node's top tokens, in order
        else:
            q = shape_probs(logits, sampling).repeat_interleave(width, dim=0)  # [n * width, V] each child's parent's law
            picked = sample_rows(q, [generator] * q.shape[0])
            laws.append(q)
        drafted.append(picked)
        if d + 1 < len(widths):
            logits = expand(first, picked, DeviceTree(0, parents[: first + picked.shape[0]]))
        first += picked.shape[0]
    return torch.cat(drafted), None if one_hot else torch.cat(laws), TreeShape(parents, widths, one_hot, slots)


def grow_dynamic(spec: TreeSpec, depth: int, root: torch.Tensor, expand: Expand) -> tuple[torch.Tensor, None, TreeShape]:
    """EAGLE-2's tree: each depth's candidates are the topk best children (by the draft's log-probability summed
    along the path) of the topk best nodes of the depth above, which are fed; the tree keeps the `nodes` best
    candidates, each with its parent (a parent scores at least its child, and a stable sort puts it first).
    The draft's top tokens (one-hot). Chosen on the device: the structure is never read by the host."""
    K, device = spec.topk, root.device
    scores, tokens = torch.log_softmax(root.float(), -1)[0].topk(K)  # [K] each: the first depth's candidates
    all_scores, all_tokens, above = [scores], [tokens], [torch.full((K,), -1, device=device)]  # above: candidates' parents
    frontier = torch.arange(K, device=device)  # [F] the candidates fed next
    fed, fed_parents = [], [torch.full((K,), -1, device=device)]  # the candidates fed; their parents among the fed
    first, total = 0, K  # nodes fed before this depth, candidates so far
    for _ in range(1, depth):  # each depth below the first
        fed.append(frontier)
        logits = expand(first, torch.cat(all_tokens)[frontier], DeviceTree(0, torch.cat(fed_parents)))  # [F, V]
        children, tokens = torch.log_softmax(logits.float(), -1).topk(K)  # [F, K]
        children = children + torch.cat(all_scores)[frontier][:, None]  # summed along the path
        all_scores.append(children.reshape(-1))
        all_tokens.append(tokens.reshape(-1))
        above.append(frontier.repeat_interleave(K))
        best = children.reshape(-1).topk(min(K, children.numel())).indices  # [F'] the next depth's to feed
        fed_parents.append(first + best // K)
        first, total, frontier = first + frontier.shape[0], total + children.numel(), total + best
    N = min(spec.nodes, total)
    kept = torch.sort(torch.cat(all_scores), descending=True, stable=True).indices[:N].sort().values  # [N] breadth first
    index = torch.full((total + 1,), -1, device=device)  # a candidate's place among the kept (entry `total`: -1)
    index[kept] = torch.arange(N, device=device)
    slot = torch.full((total + 1,), -1, device=device)  # a candidate's place among the fed
    if fed:
        fed = torch.cat(fed)
        slot[fed] = torch.arange(fed.shape[0], device=device)
    parents = index[torch.cat(above)[kept]]  # [N] -1 (a root's) picks index[-1] = -1
    return torch.cat(all_tokens)[kept], None, TreeShape(parents, [min(K, N)] * depth, True, slot[kept])
