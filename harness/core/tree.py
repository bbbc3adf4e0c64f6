"""The accept / reject rule over a token tree, as a pure function beside harness.core.rule's chain rule.

A tree of N drafted nodes hangs below the last committed token (the root): node i has token x_i and parent
parents[i] (-1: the root), and the children of a node are tried in the order they appear. The target scored
every node in one pass: p[0] is its law after the root, p[i + 1] its law after node i's path.

At a node whose law is r (p of that node), its children are tried in order:
  sampled   the siblings were drawn independently from the draft's law q at their parent (q[i]): child x is
            accepted with probability min(1, r(x) / q(x)); on rejection r becomes norm(max(0, r - q)) for the
            next sibling (SpecInfer's recursive rejection);
  one-hot   the siblings were taken as the draft's top tokens (deterministic): child x is accepted with
            probability r(x); on rejection r(x) becomes 0 and r is renormalised (EAGLE's rule).
The first accepted child is committed and the walk goes on below it with its own p. When every child of the
node reached is rejected, the next token is drawn from what remains of r; at a leaf, from the leaf's p (the
bonus). Greedy follows the target's argmax through the tree.

Why each committed token has the target's law: at one node, the chain rule's argument applies sibling by
sibling. Sampled: P(commit x at sibling 1) = q(x) min(1, r(x)/q(x)) = min(r, q)(x), and given a rejection the
rest of r is exactly norm(max(0, r - q)), the law the next sibling is tested against; by induction the
committed token is r-distributed. One-hot: P(commit x_1) = r(x_1); given a rejection the token is
r conditioned on not x_1, which is the renormalised r with r(x_1) = 0. The walk below the committed child
uses the target's law after it, so every committed token follows the target given its prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from harness.base.host_reads import from_host
from harness.core.sampling import Sampling, sample_rows, shape_probs


class TreeVerdict(NamedTuple):
    path: list[int]  # the accepted nodes, root to leaf (host ints)
    next_token: torch.Tensor  # [] the recovered or bonus token


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """{node (-1: the root): its children in trial order}."""
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        out.setdefault(parent, []).append(i)
    return out


def without(r: torch.Tensor, q: torch.Tensor | None, x, one_hot: bool) -> torch.Tensor:
    """[V] the law the next sibling is tested against once x (an int or a [] tensor) was rejected from r [V]."""
    rest = r.index_fill(0, torch.as_tensor(x, device=r.device).view(1), 0) if one_hot else (r - q).clamp_min(0)
    total = rest.sum()
    return torch.where(total > 0, rest / total, r)  # no mass left: rejection had probability 0, r stays


def uniforms(n: int, generator, device) -> torch.Tensor:
    """[n] float64 uniforms, one per node (as the chain rule's, float64: a float32 u would accept tiny ratios)."""
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device)


def below(u: torch.Tensor, i: int, a: torch.Tensor) -> bool:
    """Node i's test: its uniform below its acceptance probability a."""
    return bool(u[i] < a)


def verify_tree(
    tokens: torch.Tensor,  # [N] drafted tokens
    parents: list[int],  # [N] each node's parent (-1: the root), children after their parent
    q: torch.Tensor | None,  # [N, V] the law each sampled node was drawn from (None: one-hot)
    p: torch.Tensor,  # [N + 1, V] the target's law after the root (row 0) and after each node (row i + 1)
    generator,
) -> TreeVerdict:
    """Walk the tree from the root, accepting a child per depth or stopping (module docstring)."""
    one_hot, node, path = q is None, -1, []
    children = children_of(parents)
    u = uniforms(len(parents), generator, p.device)
    while True:
        r = p[node + 1]
        chosen = None
        for i in children.get(node, []):
            x = int(tokens[i])
            if below(u, i, r[x] if one_hot else (r[x] / q[i, x]).clamp(max=1)):
                chosen = i
                break
            r = without(r, None if one_hot else q[i], x, one_hot)
        if chosen is None:
            return TreeVerdict(path, sample_rows(r[None], [generator])[0])
        path.append(chosen)
        node = chosen


def greedy_tree(tokens: torch.Tensor, parents: list[int], argmax: torch.Tensor) -> TreeVerdict:
    """Temperature 0: the child equal to the target's argmax (argmax [N + 1], per row of p), while there is one."""
    children, node, path = children_of(parents), -1, []
    while True:
        best = int(argmax[node + 1])
        chosen = next((i for i in children.get(node, []) if int(tokens[i]) == best), None)
        if chosen is None:
            return TreeVerdict(path, argmax[node + 1])
        path.append(chosen)
        node = chosen


class TreeVerdicts(NamedTuple):
    """One row's tree verdict on the device: nothing here has been read by the host."""

    accepted: torch.Tensor  # [] nodes on the accepted path
    path: torch.Tensor  # [D] the accepted nodes, root to leaf, then -1
    next_token: torch.Tensor  # [] the recovered or bonus token


def sibling_ranks(parents: torch.Tensor) -> torch.Tensor:
    """[N] each node's place among its siblings, 0: tried first (parents [N] on the device; no host read)."""
    return (parents[:, None] == parents[None, :]).tril(-1).sum(-1)


def tree_table(parents: list[int] | torch.Tensor, widths: list[int], device) -> torch.Tensor:
    """[S, N + 1] the node tried at round s below each node (row 0 the root, i + 1 node i), or N where it has no
    s-th child; S = max(widths), at least the most children any node has. Made on the device from parents [N]
    (a host list is copied there first): no host read."""
    if not isinstance(parents, torch.Tensor):
        parents = from_host(parents, device)
    N = parents.shape[0]
    table = torch.full((max(widths, default=0), N + 1), N, dtype=torch.long, device=device)
    return table.index_put_((sibling_ranks(parents), parents + 1), torch.arange(N, device=device))


def verify_tree_rows(
    tokens: torch.Tensor,  # [N] drafted tokens
    parents: list[int] | torch.Tensor,  # [N] as verify_tree's, on the host or the device
    widths: list[int],  # [D] the most children a node has at each depth (or more: a round without a child tries nothing)
    q: torch.Tensor | None,  # [N, V] as verify_tree's (None: one-hot)
    p: torch.Tensor,  # [N + 1, V] as verify_tree's
    generator,
) -> TreeVerdicts:
    """verify_tree on the device, draw for draw (the same uniforms, tests and final draw): the walk visits one
    node per depth, held as a [1] index (a 0-d index would be read by the host), trying its children round by
    round. No host read."""
    N, device, one_hot = tokens.shape[0], p.device, q is None
    table = tree_table(parents, widths, device)  # [S, N + 1]
    u = torch.cat([uniforms(N, generator, device), torch.full((1,), 2.0, dtype=torch.float64, device=device)])  # [N + 1]
    padded = torch.cat([tokens, tokens.new_zeros(1)])  # [N + 1]: node N stands for "no child", never accepted
    q = None if one_hot else torch.cat([q, q[:1]])  # [N + 1, V]
    node, stopped, r, path = tokens.new_zeros(1), torch.zeros(1, dtype=torch.bool, device=device), p[0], []
    for width in widths:
        chosen = torch.full_like(node, -1)  # [1]
        for s in range(width):
            child = table[s].index_select(0, node)  # [1] the node tried, or N
            x = padded.index_select(0, child)  # [1]
            law = None if one_hot else q.index_select(0, child)[0]  # [V] the draft's law the child was drawn from
            a = r.index_select(0, x) if one_hot else (r.index_select(0, x) / law.index_select(0, x)).clamp(max=1)
            trial = ~stopped & (child < N) & (chosen < 0)
            accepted = trial & (u.index_select(0, child) < a)
            chosen = torch.where(accepted, child, chosen)
            r = torch.where(trial & ~accepted, without(r, law, x, one_hot), r)
        took = ~stopped & (chosen >= 0)
        path.append(torch.where(took, chosen, -1))
        r = torch.where(took, p.index_select(0, chosen.clamp(min=-1) + 1)[0], r)  # below the accepted child: its law
        node, stopped = torch.where(took, chosen + 1, node), ~took
    path = torch.cat(path) if path else torch.zeros(0, dtype=torch.long, device=device)
    return TreeVerdicts((path >= 0).sum(), path, sample_rows(r[None], [generator])[0])


def greedy_tree_rows(
    tokens: torch.Tensor, parents: list[int] | torch.Tensor, widths: list[int], argmax: torch.Tensor
) -> TreeVerdicts:
    """greedy_tree on the device (argmax [N + 1]). No host read."""
    device = argmax.device
    table = tree_table(parents, widths, device)  # [S, N + 1]
    padded = torch.cat([tokens, tokens.new_full((1,), -1)])  # [N + 1]: "no child" matches no token
    node, stopped, path = tokens.new_zeros(1), torch.zeros(1, dtype=torch.bool, device=device), []
    for width in widths:
        children = table[:width].index_select(1, node)[:, 0]  # [width]
        match = padded.index_select(0, children) == argmax.index_select(0, node)  # [width]
        first = children.gather(0, match.long().argmax().view(1))  # [1] the first child that is the argmax
        chosen = torch.where(match.any() & ~stopped, first, -1)
        path.append(chosen)
        node, stopped = torch.where(chosen >= 0, chosen + 1, node), chosen < 0
    path = torch.cat(path) if path else torch.zeros(0, dtype=torch.long, device=device)
    return TreeVerdicts((path >= 0).sum(), path, argmax.index_select(0, node)[0])


def verify_tree_cycle(
    tokens: torch.Tensor,  # [N] drafted nodes
    parents: list[int] | torch.Tensor,
    widths: list[int],
    q: torch.Tensor | None,  # [N, V] (None: one-hot, or greedy)
    scored: torch.Tensor,  # [N + 1, V] the target's logits after the root and after each node
    sampling: Sampling,
    generator,
) -> TreeVerdicts:
    """The loop's verdict on a tree: greedy through it at temperature 0, else the rule on the shaped laws."""
    if sampling.greedy:
        return greedy_tree_rows(tokens, parents, widths, scored.argmax(-1))
    return verify_tree_rows(tokens, parents, widths, q, shape_probs(scored, sampling), generator)
