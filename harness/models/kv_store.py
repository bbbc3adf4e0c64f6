"""KV storage written in place, for a batch's rows: the one cache of the lean forward and the feature heads.

Per layer, keys and values [rows, kv_heads, capacity, head_dim], grown in multiples of ROOM. Each row has
its own length (kept by the caller: a rollback only moves it); a step writes at each row's positions and
attention reads the first `end` positions, a causal mask hiding what lies past a row's own (padding, or
what a rollback dropped). A captured step (`fixed_step`) reads the whole capacity: fixed shapes.

A token tree (one row) is fed in one step: `tree` lists the parents of the last len(tree) slots (-1: the slot
before them), each node at the position of its depth and seeing only the slots before the tree and its own
ancestors (`tree_layout`, made on the device from a `DeviceTree`: the host never reads a tree's structure);
`compact` then moves the accepted path's slots together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.base.host_reads import from_host

ROOM = 256  # the storage grows in multiples of this many positions


@dataclass(frozen=True)
class DeviceTree:
    """A tree of len(self) slots whose structure stays on the device: `chain` slots in a chain, then the nodes,
    parents [N], parents[i] in -1..i-1 (-1: the last chain slot, or with no chain the slot before)."""

    chain: int
    parents: torch.Tensor  # [N]

    def __len__(self) -> int:
        return self.chain + self.parents.shape[0]


Tree = list[int] | DeviceTree  # a token tree as the forwards take it: host parents (small), or kept on the device


def is_chain(tree: Tree) -> bool:
    """Whether the tree is a chain (each node the child of the one before): a plain causal step. A DeviceTree is
    taken as a tree (its mask is right for a chain too)."""
    if isinstance(tree, DeviceTree):
        return tree.parents.shape[0] == 0
    return all(parent == j - 1 for j, parent in enumerate(tree))


def ancestry(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: node i's ancestors among the nodes, and itself (parents [N], each before its child, -1 above
    the nodes). The parent-or-self relation squared until it spans the deepest path: no host read."""
    nodes = torch.arange(parents.shape[0], device=parents.device)
    seen = ((parents[:, None] == nodes) | (nodes[:, None] == nodes)).float()  # [N, N]
    for _ in range(max(parents.shape[0] - 2, 0).bit_length()):  # paths of up to 2^steps >= N - 1 edges
        seen = (seen @ seen > 0).float()
    return seen.bool()


def tree_layout(tree: Tree, start: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [T] and the attention mask [T, start + T] (True: attended) of the last `width` of a tree's slots,
    made on the device from its parents (`ancestry`): no host read.

    Slot base + j (base = start + width - len(tree)) sits at position base + depth(j) - 1 and sees the slots before
    base, its ancestors and itself. A DeviceTree's leading chain (a verify pass's unseen committed tokens, the whole
    prompt in the first cycle) is causal; its nodes hang below the chain's last slot. A host list tree[j] gives the
    parent (an index into `tree`, before j, or -1: the slot base - 1) of slot base + j: a DeviceTree without a chain."""
    if not isinstance(tree, DeviceTree):
        if not all(-1 <= parent < j for j, parent in enumerate(tree)):
            raise ValueError(f"a tree's parents come before their children: {tree}")
        tree = DeviceTree(0, from_host(tree, device))
    n, N = len(tree), tree.parents.shape[0]
    base, fed = start + width - n, min(width, N)  # the tree's first slot; its nodes among the fed slots
    if not (width <= n and base >= 0):
        raise ValueError(f"a tree of {n} slots feeding {width} after {start} cached")
    seen = ancestry(tree.parents)  # [N, N]
    depth = seen.sum(-1)  # [N] counted from the last chain slot (or the slot before the tree)
    chain = torch.arange(base + min(n - width, tree.chain), base + tree.chain, device=device)  # the chain slots fed
    positions = torch.cat([chain, base + tree.chain - 1 + depth[N - fed :]])  # [T]
    mask = torch.arange(start + width, device=device) <= base + torch.arange(n - width, n, device=device)[:, None]
    mask[width - fed :, base + tree.chain : base + n] = seen[N - fed :]  # [T, start + T]
    return positions, mask


@dataclass
class Step:
    """Where a step lands: positions [B, T], the mask (None, [T, end] or [B, 1, T, end]), `end` read, the write index
    into a layer's storage (rows, heads, positions)."""

    positions: torch.Tensor
    mask: torch.Tensor | None
    end: int
    index: tuple[slice, slice, slice] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def compaction(base: int, kept: list[int], device: torch.device) -> tuple[slice, torch.Tensor] | None:
    """The slots to write (a slice) and the index [n] of those to read there, moving slots base + kept[j] to base + j
    (the leading ones already in place left out); None when nothing moves."""
    if any(b <= a for a, b in zip(kept, kept[1:])) or kept and kept[0] < 0:
        raise ValueError(f"the slots kept are increasing tree indices, not {kept}")
    first = next((j for j, k in enumerate(kept) if k != j), len(kept))
    if first == len(kept):
        return None
    return slice(base + first, base + len(kept)), from_host([base + k for k in kept[first:]], device)


class KVStore:
    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, like: torch.Tensor):
        self.layers, self.rows, self.kv_heads, self.head_dim = layers, rows, kv_heads, head_dim
        self.like = like  # a tensor of the dtype and device to store in
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []

    def reserve(self, length: int) -> None:
        """Room for `length` positions per row, rounded up to ROOM; what is stored is kept."""
        if length <= self.capacity:
            return
        capacity = -(-length // ROOM) * ROOM
        shape = (self.rows, self.kv_heads, capacity, self.head_dim)
        keys = [self.like.new_zeros(shape) for _ in range(self.layers)]
        values = [self.like.new_zeros(shape) for _ in range(self.layers)]
        for old, new in zip(self.keys + self.values, keys + values):
            new[:, :, : self.capacity] = old
        self.keys, self.values, self.capacity = keys, values, capacity

    def keep_rows(self, kept: list[int]) -> None:
        """Move the stored rows `kept` (indices, in order) to the first len(kept) rows: a batch drops the others."""
        if kept == list(range(len(kept))):
            return
        index = from_host(kept, self.like.device)
        for stored in self.keys + self.values:
            stored[: len(kept)] = stored[index]

    def compact(self, row: int, base: int, kept: list[int]) -> None:
        """Move row `row`'s slots base + kept[j] (kept increasing) to base + j in every layer: a tree's accepted path
        made contiguous. The row's length is the caller's."""
        if moves := compaction(base, kept, self.like.device):
            target, source = moves
            for stored in self.keys + self.values:
                stored[row, :, target] = stored[row].index_select(1, source)  # a gathered copy: source may overlap target

    def step(self, starts: list[int], width: int, tree: Tree | None = None) -> Step:
        """A step of `width` positions per row after starts[i] stored ones (host ints: no device read); with a `tree`
        (one row, `tree_layout`) at the tree's positions with its mask, written to the same slots."""
        device, B = self.like.device, len(starts)
        end = max(starts) + width
        if end > self.capacity:
            self.reserve(max(end, 2 * self.capacity))
        if tree is not None and not is_chain(tree):
            assert B == 1, "a token tree is fed to one row"
            positions, mask = tree_layout(tree, starts[0], width, device)  # [T], [T, end]
            return Step(positions[None], mask, end, (slice(0, 1), slice(None), slice(starts[0], end)))
        if B == 1:
            positions = torch.arange(starts[0], end, device=device)[None]  # [1, T]
            mask = None if width == 1 else torch.arange(end, device=device) <= positions[0, :, None]  # [T, end]
            return Step(positions, mask, end, (slice(0, 1), slice(None), slice(starts[0], end)))
        return self._at(from_host(starts, device)[:, None] + torch.arange(width, device=device), end)  # positions [B, T]

    def fixed_step(self, positions: torch.Tensor) -> Step:
        """A step at positions [rows, T] (`fixed_positions`) over the whole capacity: shapes depend on rows and T only."""
        return self._at(positions, self.capacity)

    def fixed_positions(self, starts: list[int], width: int) -> torch.Tensor:
        """Positions [rows, T] of a captured step: the first len(starts) rows at starts.., finished rows at 0 (their
        padding never read). A row past the capacity grows the storage: a new shape, which a sealed step refuses."""
        self.reserve(max(starts) + width)
        device = self.like.device
        return from_host(list(starts) + [0] * (self.rows - len(starts)), device)[:, None] + torch.arange(width, device=device)

    def _at(self, positions: torch.Tensor, end: int) -> Step:
        """A step at positions [B, T] reading the first `end` positions of each row, the mask causal per row."""
        device = positions.device
        mask = (torch.arange(end, device=device) <= positions[..., None])[:, None]  # [B, 1, T, end]
        rows = torch.arange(positions.shape[0], device=device)[:, None, None]  # [B, 1, 1]
        heads = torch.arange(self.kv_heads, device=device)[None, :, None]  # [1, kv_heads, 1]
        return Step(positions, mask, end, (rows, heads, positions[:, None, :]))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys and values [B, kv_heads, T, D] where `step` says; those attention reads [B, kv_heads, end, D]."""
        keys, values = self.keys[layer], self.values[layer]
        keys[step.index], values[step.index] = k, v
        return keys[: k.shape[0], :, : step.end], values[: k.shape[0], :, : step.end]
