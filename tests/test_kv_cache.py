"""The dynamic cache's in-place layers (harness.models.kv_cache) against HF's DynamicCache."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from harness.models.cached import CachedLM, cache_kwarg
from harness.models.kv_cache import GrowingLayer, in_place
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
        return model(input_ids=chunk.unsqueeze(0), **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=n).logits[0]

    def rollback(length):
        if length < cache.get_seq_length():
            cache.crop(length - cache.get_seq_length())

    return steps(forward, rollback, ids)


def llama(kv_heads: int, attention: str):
    return tiny_model(
        LlamaForCausalLM,
        40,
        seed=3,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation=attention,
    )


@pytest.mark.parametrize("capacity", [4, 64])  # 4: storage outgrown several times
@pytest.mark.parametrize("kv_heads, attention", [(2, "sdpa"), (4, "sdpa"), (4, "eager")])  # GQA copies K/V; MHA reads the views
def test_logits_are_those_of_hfs_dynamic_cache_bit_for_bit(capacity, kv_heads, attention):
    model = llama(kv_heads, attention)
    lm = CachedLM(model, vocab_size=40)
    for layer in lm.backend.growing.values():
        layer.capacity = capacity
    for seed in (0, 1):  # the second sequence reuses the first's storage, filled with NaN in between
        ids = torch.randint(3, 40, (48,), generator=torch.Generator().manual_seed(seed))
        lm.reset()
        ours = steps(lambda chunk, n: lm.forward(chunk, n), lm.rollback, ids)
        assert all(type(layer) is GrowingLayer for layer in lm.cache.layers)
        for mine, theirs in zip(ours, hf_reference(model, ids), strict=True):
            assert torch.equal(mine, theirs)
        with torch.inference_mode():  # the storage is an inference tensor, as the loop's
            for layer in lm.backend.growing.values():
                layer._keys.fill_(float("nan")), layer._values.fill_(float("nan"))


def test_a_copy_has_a_cache_of_its_own():
    """The draft-is-target control drafts with copy.copy(target): the two must not share storage."""
    import copy

    lm = CachedLM(llama(2, "sdpa"), vocab_size=40)
    lm.reserve(300)
    other = copy.copy(lm)
    assert other.model is lm.model and other.cache is not lm.cache
    assert all(
        other.backend.growing[i] is not layer and other.backend.growing[i].capacity == 300
        for i, layer in lm.backend.growing.items()
    )
    lm.forward(torch.arange(3, 13))
    keys = [layer.keys.clone() for layer in lm.cache.layers]
    other.forward(torch.arange(20, 23))
    assert lm.cache.get_seq_length() == 10 and other.cache.get_seq_length() == 3
    assert all(torch.equal(layer.keys, before) for layer, before in zip(lm.cache.layers, keys))  # nothing written into lm's


def test_storage_is_kept_across_sequences_and_reserved_ahead():
    lm = CachedLM(llama(2, "sdpa"), vocab_size=40)
    lm.reserve(300)
    lm.forward(torch.arange(3, 13))
    storage = {i: layer._keys.data_ptr() for i, layer in lm.backend.growing.items()}
    assert all(layer._keys.shape[-2] == 300 for layer in lm.backend.growing.values())
    lm.reset()
    lm.forward(torch.arange(3, 20))
    assert {i: layer._keys.data_ptr() for i, layer in lm.backend.growing.items()} == storage
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
    model = llama(2, "sdpa")
    assert all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
    sliding, _ = sliding_window_pair(window=8)
    kept: dict = {}
    cache = in_place(DynamicCache(config=sliding.config), kept)
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers) and not kept


def test_the_benchs_timed_wrapper_has_a_cache_of_its_own():
    from harness.bench.timing import TimedLM

    lm = CachedLM(llama(2, "sdpa"), vocab_size=40)
    lm.reserve(300)
    timed = TimedLM(lm)
    assert timed.model is lm.model and timed.cache is not lm.cache
    assert all(
        timed.backend.growing[i] is not layer and timed.backend.growing[i].capacity == 300
        for i, layer in lm.backend.growing.items()
    )
    lm.forward(torch.arange(3, 13))
    timed.forward(torch.arange(20, 23))
    assert lm.cache.get_seq_length() == 10 and timed.cache.get_seq_length() == 3 and timed.forwards == 1


def test_the_benchs_timed_wrapper_shares_a_static_cache_and_times_prefills():
    """Compiled steps (CUDA graphs above all) are bound to a static cache's tensors: the bench's timed
    copies share it (they run in turns with the original), while copy.copy gets a cache of its own."""
    import copy

    from harness.bench.timing import TimedLM

    lm = CachedLM(llama(2, "sdpa"), vocab_size=40, cache="static", max_len=256)
    timed = TimedLM(lm)
    assert timed.cache is lm.cache and timed.lm.backend is not lm.backend and copy.copy(lm).cache is not lm.cache
    expected = lm.prefill(torch.arange(3, 13))
    lm.reset()
    assert torch.equal(timed.prefill(torch.arange(3, 13)), expected)
    assert timed.forwards == 1 and timed.by_positions[10][1] == 1 and timed.length == 10 and lm.length == 0
    timed.rollback(4)
    assert timed.length == 4 and timed.rollback_s > 0
