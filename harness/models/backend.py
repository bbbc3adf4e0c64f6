"""What CachedLM (harness.models.cached) drives: one model's forward over a KV cache of its own.

Backends: HF's modules with a dynamic or a static cache, optionally compiled (harness.models.hf_backends),
and the lean forward (harness.models.lean).
"""

from __future__ import annotations

import torch

from harness.models.kv_store import Tree


class Backend:
    """One model and its KV cache, batch of one: `length` positions cached, sized for `capacity` (a static
    cache's slots, else the model's context). A new backend is ready for its first forward."""

    length: int = 0
    capacity: int
    compiled = None  # the torch.compile'd step, where steps are compiled (HF backends with compile=True)
    graphs: bool = False  # compiled with CUDA graphs (mode="reduce-overhead")
    output_reused: bool = False  # the last forward's logits live in a buffer its next call overwrites (a CUDA graph's)
    cache = None  # the transformers cache object, where there is one
    lean = None  # the lean forward (harness.models.lean.LeanLlama), where it runs the steps

    def forward(self, input_ids: torch.Tensor, num_logits: int, tree: Tree | None = None) -> torch.Tensor:
        """Append input_ids [T] to the cache; logits [num_logits, V] of the last positions (V: the head's rows).

        tree: a token tree over the last len(tree) cached slots (ending with these T; the first len(tree) - T fed
        before): a host list of parents, each an index into `tree` before its own or -1 (the slot before the
        tree), or a harness.models.kv_store.DeviceTree (a leading chain, then nodes; parents on the device).
        A node sits at the position of its depth (first level: right after the slots before the tree) and
        attends to those slots and its own ancestors only (harness.models.kv_store.tree_layout). None, or a
        chain: the plain causal step. A backend that cannot run trees refuses them (HarnessError)."""
        raise NotImplementedError

    def forward_features(
        self, input_ids: torch.Tensor, num_logits: int, layers: tuple[int, ...], tree: Tree | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, and the hidden states [T, len(layers) * hidden] at every fed position: for index
        i < L (the layer count) the input of layer i, for i = L the final normed state."""
        raise NotImplementedError

    def compact(self, base: int, kept: list[int]) -> None:
        """Move the cached slots base + kept[j] (kept increasing) to base + j: a tree's accepted path made
        contiguous, to be followed by rollback(base + len(kept)). `length` does not change."""
        raise NotImplementedError

    def reset(self, rollback: bool = True) -> None:
        """Empty the cache: a new sequence starts. rollback=False: it will never be rolled back."""
        raise NotImplementedError

    def reserve(self, max_len: int) -> None:
        """Make room for sequences of up to max_len positions."""
        raise NotImplementedError

    def can_roll_back(self, length: int) -> bool:
        """Whether a rollback to `length` finds what it restores."""
        return True

    def rollback(self, length: int) -> None:
        """Drop cached positions at and beyond `length`."""
        raise NotImplementedError

    def copy(self, share_static_cache: bool = False) -> Backend:
        """The same model (and compiled steps) with an empty cache of its own; share_static_cache=True keeps
        a static cache shared."""
        raise NotImplementedError
