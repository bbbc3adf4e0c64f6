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
    """One proposal's tree: node i's parent (-1: the last committed token), each depth's most children of a
    node (the rule's rounds), and where the drafter cached each node (-1: not fed, a leaf)."""

    parents: list[int]
    widths: list[int]
    one_hot: bool  # candidates were the draft's top tokens: the rule takes no q
    slots: list[int]  # node i's slot among the nodes the drafter fed, or -1

    def with_prefix(self, chain: int) -> list[int]:
        """Parents of a verify pass's fed slots: `chain` committed tokens (a chain), then the nodes below the last."""
        return list(range(-1, chain - 1)) + [chain + p if p >= 0 else chain - 1 for p in self.parents]

    def rank_of(self, node: int) -> int:
        """The node's place among its siblings (0: tried first)."""
        return self.parents[:node].count(self.parents[node])


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


def depth_widths(parents: list[int]) -> list[int]:
    """Per depth, the most children any node at the depth above has."""
    depth = []
    for p in parents:
        depth.append(1 + (depth[p] if p >= 0 else 0))
    return [max(parents.count(p) for p, d in zip(parents, depth) if d == level) for level in range(1, max(depth, default=0) + 1)]


Expand = Callable[[int, torch.Tensor, list[int]], torch.Tensor]  # (first fed, tokens [n], parents of the fed) -> [n, V]


def grow(
    spec: TreeSpec, depth: int, root: torch.Tensor, expand: Expand, sampling: Sampling, generator
) -> tuple[torch.Tensor, torch.Tensor | None, TreeShape]:
    """Draft a tree of up to `depth` levels below the root's logits [1, V]; expand(first, tokens, parents) feeds a
    level's nodes (the fed nodes' parents, among the fed) and gives their logits. (tokens [N], q [N, V] or None, shape)."""
    if spec.dynamic:
        return grow_dynamic(spec, depth, root, expand)
    widths = list(spec.widths[:depth])
    parents = static_parents(widths)
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
            logits = expand(first, picked, parents)
        first += picked.shape[0]
    fed = len(parents) - math.prod(widths)  # every level but the last, breadth first: the first nodes
    shape = TreeShape(parents, widths, one_hot, [i if i < fed else -1 for i in range(len(parents))])
    return torch.cat(drafted), None if one_hot else torch.cat(laws), shape


def grow_dynamic(spec: TreeSpec, depth: int, root: torch.Tensor, expand: Expand) -> tuple[torch.Tensor, None, TreeShape]:
    """EAGLE-2's tree: each depth's candidates are the topk best children (by the draft's log-probability summed
    along the path) of the topk best nodes of the depth above, which are fed; the tree keeps the `nodes` best
    candidates, each with its parent (a parent scores at least its child, and a stable sort puts it first).
    The draft's top tokens (one-hot). One host read per depth below the first (the nodes to feed) and one for the kept."""
    K = spec.topk
    scores, tokens = torch.log_softmax(root.float(), -1)[0].topk(K)  # [K] each
    all_scores, all_tokens, parents, fed = [scores], [tokens], [-1] * K, []
    frontier = list(range(K))  # the candidates fed next
    for d in range(1, depth):
        index = from_host(frontier, root.device)
        logits = expand(
            len(fed), torch.cat(all_tokens)[index], [fed.index(parents[c]) if parents[c] >= 0 else -1 for c in fed + frontier]
        )
        fed += frontier
        children, tokens = torch.log_softmax(logits.float(), -1).topk(K)  # [F, K]
        children = children + torch.cat(all_scores)[index][:, None]
        first = len(parents)
        all_scores.append(children.reshape(-1))
        all_tokens.append(tokens.reshape(-1))
        parents += [c for c in frontier for _ in range(K)]
        if d + 1 < depth:
            frontier = [first + i for i in children.reshape(-1).topk(min(K, children.numel())).indices.tolist()]  # host read
    order = torch.sort(torch.cat(all_scores), descending=True, stable=True).indices[: spec.nodes]
    kept = sorted(order.tolist())  # host read; breadth first (candidates are numbered depth by depth)
    where = {c: i for i, c in enumerate(kept)}
    tree_parents = [where[parents[c]] if parents[c] >= 0 else -1 for c in kept]
    shape = TreeShape(tree_parents, depth_widths(tree_parents), True, [fed.index(c) if c in fed else -1 for c in kept])
    return torch.cat(all_tokens)[from_host(kept, root.device)], None, shape
