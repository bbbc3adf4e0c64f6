"""A dynamic KV cache that does not copy itself at every step (docs/design.md).

HF's DynamicCache appends each step with `torch.cat`, copying every layer's cache per forward. `GrowingLayer`
keeps a full-attention layer's keys and values in storage allocated ahead and written in place; the model
sees views of the first `length` positions, and a rollback only moves `length`. `in_place` swaps these
layers into a DynamicCache; sliding-window and other special layers keep HF's own.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of storage written in place."""

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = capacity  # positions to allocate, at least; `reserve` raises it
        self.length = 0
        self._keys: torch.Tensor | None = None  # [B, H, capacity, D] storage
        self._values: torch.Tensor | None = None

    def reserve(self, capacity: int) -> None:
        """Allocate room for `capacity` positions at the next sequence's start."""
        self.capacity = max(self.capacity, capacity)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        stored = self._keys
        fits = (
            stored is not None
            and stored.shape[-2] >= self.capacity
            and stored.device == key_states.device
            and stored.dtype == key_states.dtype
            and stored.shape[:2] == key_states.shape[:2]
            and stored.shape[-1] == key_states.shape[-1]
            and self._values.shape[-1] == value_states.shape[-1]
        )
        self.length = 0
        if not fits:
            self._allocate(key_states, value_states, self.capacity)
        self.is_initialized = True

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """New storage of `capacity` positions, holding the first `length` of the old."""
        batch, heads = key_states.shape[:2]
        keys = key_states.new_empty(batch, heads, capacity, key_states.shape[-1])
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if self.length:
            keys[:, :, : self.length].copy_(self._keys[:, :, : self.length])
            values[:, :, : self.length].copy_(self._values[:, :, : self.length])
        self._keys, self._values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key_states/value_states [B, H, T, D] after the cached positions; views of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            self._allocate(key_states, value_states, max(end, 2 * self._keys.shape[-2]))
        self._keys[:, :, self.length : end].copy_(key_states)
        self._values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys, self.values

    def _cleared(self, value: None) -> None:  # HF's layer code clears keys and values; the storage stays
        assert value is None, "GrowingLayer's keys and values are views of its storage: write them with update()"

    # Views [B, H, length, D] of the first `length` positions, made when read, so that a rollback only moves `length`.
    keys = property(lambda self: self._keys[:, :, : self.length] if self.is_initialized else None, _cleared)
    values = property(lambda self: self._values[:, :, : self.length] if self.is_initialized else None, _cleared)

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers 5: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not {tokens_to_remove}")
        if self.is_initialized:
            self.length = max(self.length + tokens_to_remove, 0)

    def reset(self) -> None:
        """A new sequence: the storage stays for it."""
        self.length = 0
        self.is_initialized = False

    def _one_sequence(self, *args, **kwargs):
        raise NotImplementedError("GrowingLayer holds one sequence: beam search and batch reordering need HF's DynamicCache")

    batch_repeat_interleave = batch_select_indices = reorder_cache = offload = prefetch = _one_sequence


def in_place(cache: DynamicCache, kept: dict[int, GrowingLayer]) -> DynamicCache:
    """Swap the cache's plain full-attention layers for GrowingLayers, the same ones each time (`kept`: index -> layer)."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            grown = kept.setdefault(index, GrowingLayer())
            grown.reset()
            cache.layers[index] = grown
    return cache
