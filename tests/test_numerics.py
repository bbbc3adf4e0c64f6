"""Numerical safety: non-finite logits, residuals with no mass, half precision."""

from __future__ import annotations

import torch

from harness.rule import verify
from harness.sampling import Sampling, greedy_token, sample, shape_probs

T1 = Sampling(1.0)


def test_non_finite_logits_have_one_fixed_meaning():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [1.0, nan, 0.0, -inf],  # NaN: impossible
        [1.0, inf, 0.0, inf],  # +inf: all mass on those, equally
        [nan, nan, -inf, -inf],  # nothing usable: uniform
    ])
    p = shape_probs(logits, T1)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(3))
    assert p[0, 1] == 0 and p[0, 3] == 0 and p[0, 0] > p[0, 2] > 0
    torch.testing.assert_close(p[1], torch.tensor([0.0, 0.5, 0.0, 0.5]))
    torch.testing.assert_close(p[2], torch.full((4,), 0.25))
    assert torch.isfinite(shape_probs(logits, Sampling(0.7, top_k=2, top_p=0.9))).all()


def test_residual_without_mass_falls_back_to_p():
    """If rounding leaves p <= q everywhere, the residual has no mass; a rejection
    there (probability ~0 in exact arithmetic) must still recover a token of p.
    q is over-normalised here to make that branch frequent."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.9, 0.9, 0.0]])  # residual max(0, p - q) = 0
    draft = torch.tensor([0])
    rejected = 0
    for seed in range(300):
        v = verify(draft, q, p, torch.Generator().manual_seed(seed))
        if v.num_accepted == 0:
            rejected += 1
            assert p[0, int(v.next_token)] > 0
    assert 90 < rejected < 180  # P(reject) = 1 - 0.5 / 0.9 = 0.44


def test_sampling_never_picks_a_zero_weight_token():
    weights = torch.zeros(2000, 5_000)  # 2,000 independent rows at once: 10M exponential draws
    weights[:, [3, 7]] = torch.tensor([1.0, 3.0])
    draws = sample(weights, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {3, 7}
    assert 0.7 < (draws == 7).float().mean() < 0.8


def test_half_precision_logits_give_float32_probabilities():
    logits = torch.randn(3, 100, dtype=torch.float16) * 4
    for dtype in (torch.float16, torch.bfloat16):
        p = shape_probs(logits.to(dtype), Sampling(0.7, top_p=0.9))
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.sum(-1), torch.ones(3))
    assert shape_probs(logits.double(), T1).dtype == torch.float64


def test_greedy_token_is_torch_argmax():
    """The blocked argmax the loop uses on a CPU gives torch.argmax's index: the first of equal
    maxima (ties across and within blocks), NaN as the largest, any vocabulary size."""
    nan, inf = float("nan"), float("inf")
    generator = torch.Generator().manual_seed(0)
    for vocab in (49152, 32000, 151936, 50257):  # blocks of 256, 256, 128; an odd size: torch's own argmax
        logits = torch.randn(6, vocab, generator=generator)
        logits[1, [vocab // 2, vocab - 1, 3]] = 9.0  # a tie: the first index wins
        logits[2, :] = -inf
        logits[3, [vocab - 2, vocab // 3]] = nan  # NaN beats any value, the first NaN wins
        logits[3, 0] = inf
        logits[4] = logits[4].to(torch.bfloat16).round()  # many ties within a block
        logits[5, 1:3] = 5.0
        for rows in (logits, logits[0], logits[:, None]):  # [R, V], [V], [R, 1, V]
            assert torch.equal(greedy_token(rows), rows.argmax(-1)), vocab
        assert greedy_token(logits[1]) == 3
