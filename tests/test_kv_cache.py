"""The dynamic cache's in-place layers (harness.kv_cache) against HF's DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from harness.kv_cache import GrowingLayer, in_place
from harness.models import CachedLM
from tests.conftest import make_model
from tests.test_loop import sliding_window_pair


def steps(lm_forward, rollback, ids: torch.Tensor) -> list[torch.Tensor]:
    """A prompt, then verify-like passes of 1 to 5 positions, some rolled back, as the loop takes them."""
    out = [lm_forward(ids[:7], 1)]
    pos = 7
    for size, keep in [(3, 1), (5, 5), (1, 1), (4, 0), (2, 2), (5, 3), (1, 1), (5, 2)]:
        out.append(lm_forward(ids[pos : pos + size], size))
        rollback(pos + keep)
        pos += keep
    out.append(lm_forward(ids[pos : pos + 3], 3))
    return out


@torch.inference_mode()
def hf_reference(model, ids: torch.Tensor) -> list[torch.Tensor]:
    cache = DynamicCache(config=model.config)

    def forward(chunk, n):
        return model(input_ids=chunk.unsqueeze(0), cache=cache, use_cache=True, logits_to_keep=n).logits[0]

    def rollback(length):
        if length < cache.get_seq_length():
            cache.crop(length - cache.get_seq_length())
    return steps(forward, rollback, ids)


@pytest.mark.parametrize("capacity", [4, 64])  # 4: storage outgrown several times
def test_logits_are_those_of_hfs_dynamic_cache_bit_for_bit(capacity):
    model = make_model(vocab_size=40, seed=3, layers=2)
    ids = torch.randint(3, 40, (48,), generator=torch.Generator().manual_seed(0))
    lm = CachedLM(model, vocab_size=40)
    for layer in lm.growing.values():
        layer.capacity = capacity
    for _ in range(2):  # the second sequence reuses the first's storage
        lm.reset()
        ours = steps(lambda chunk, n: lm.forward(chunk, n), lm.rollback, ids)
        assert all(type(layer) is GrowingLayer for layer in lm.cache.layers)
        for mine, theirs in zip(ours, hf_reference(model, ids), strict=True):
            assert torch.equal(mine, theirs)


def test_storage_is_kept_across_sequences_and_reserved_ahead():
    lm = CachedLM(make_model(vocab_size=40, seed=3, layers=2), vocab_size=40)
    lm.reserve(300)
    lm.forward(torch.arange(3, 13))
    storage = {i: layer._keys.data_ptr() for i, layer in lm.growing.items()}
    assert all(layer._keys.shape[-2] == 300 for layer in lm.growing.values())
    lm.reset()
    lm.forward(torch.arange(3, 20))
    assert {i: layer._keys.data_ptr() for i, layer in lm.growing.items()} == storage
    assert [layer.get_seq_length() for layer in lm.cache.layers] == [17, 17]


def test_growing_keeps_what_was_written():
    layer = GrowingLayer(capacity=2)
    chunks = [torch.randn(1, 2, n, 4) for n in (1, 2, 3)]  # storage 2 -> 4 -> 8 (doubling)
    for chunk in chunks:
        keys, values = layer.update(chunk, -chunk)
    assert layer._keys.shape[-2] == 8 and torch.equal(keys, torch.cat(chunks, dim=-2)) and torch.equal(values, -keys)
    layer.crop(-4)
    assert layer.get_seq_length() == 2 and torch.equal(layer.keys, torch.cat(chunks[:2], dim=-2)[:, :, :2])
    layer.crop(0)
    assert layer.get_seq_length() == 2
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(1)
    with pytest.raises(NotImplementedError, match="one sequence"):
        layer.batch_repeat_interleave(2)


def test_hf_keeps_its_own_layers_and_sliding_windows_keep_theirs():
    """Importing the module registers nothing with transformers, so HF generate() in the bench
    runs on its own DynamicCache; sliding-window layers are not swapped."""
    model = make_model(vocab_size=40, seed=3, layers=2)
    assert all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
    sliding, _ = sliding_window_pair(window=8)
    kept: dict = {}
    cache = in_place(DynamicCache(config=sliding.config), kept)
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers) and not kept
