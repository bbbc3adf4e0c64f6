"""Numerical safety: non-finite logits, residuals with no mass, half precision."""

from __future__ import annotations

import torch

from harness.core import sampling
from harness.core.rule import verify
from harness.core.sampling import Sampling, nucleus_floor, sample, shape_probs

T1 = Sampling(1.0)


def test_non_finite_logits_have_one_fixed_meaning():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [1.0, nan, 0.0, -inf],  # NaN: impossible
            [1.0, inf, 0.0, inf],  # +inf: all mass on those, equally
            [nan, nan, -inf, -inf],  # nothing usable: uniform
        ]
    )
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


def test_every_rung_of_the_nucleus_ladder_gives_the_same_floor(monkeypatch):
    """top_p set to a row's cumulative mass at its 256th token, where a rounded 'mass before'
    made the 256 candidates keep one token fewer than the full sort: the floors now agree."""
    generator = torch.Generator().manual_seed(0)
    probs = (0.5 * torch.randn(400, 1000, generator=generator)).softmax(-1)  # [R, V]
    cumulative = probs.sort(descending=True).values.cumsum(-1)[:, 255]  # [R]
    floors = []
    for ladder in (sampling.NUCLEUS_CANDIDATES, ()):  # 256 candidates first, then the full sort only
        monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", ladder)
        floors.append(torch.cat([nucleus_floor(row[None], float(p)) for row, p in zip(probs, cumulative) if p < 1]))
    assert torch.equal(floors[0], floors[1])
    assert ((probs >= floors[0]).sum(-1) == 256).float().mean() > 0.5  # mostly the 256 tokens reaching top_p


def test_a_top_p_that_rounds_to_zero_keeps_the_most_probable_token():
    p = shape_probs(torch.tensor([[3.0, 1.0, 0.0, -2.0]]), Sampling(1.0, top_p=1e-46))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_acceptance_coins_have_float64_resolution():
    """Float32 models, float64 coins: with p/q set to the float32 just above each position's
    float64 uniform every draft is accepted; just below it, the first is rejected. A float32
    coin (multiples of 2^-24, drawn from other bits) could not follow thresholds that fine."""
    k, seed = 24, 5
    coins = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)  # [k]
    nearest = coins.float()  # [k]
    above = torch.where(nearest.double() > coins, nearest, torch.nextafter(nearest, torch.tensor(2.0)))
    below = torch.where(nearest.double() < coins, nearest, torch.nextafter(nearest, torch.tensor(-1.0)))
    draft_tokens = torch.zeros(k, dtype=torch.long)
    q = torch.tensor([[1.0, 0.0]]).expand(k, 2)  # [k, V]: every draft certain, so p(x) / q(x) = p(x)
    for p_x, accepted in ((above, k), (below, 0)):
        p = torch.cat([torch.stack([p_x, 1 - p_x], -1), torch.tensor([[0.5, 0.5]])])  # [k + 1, V], the bonus row last
        assert verify(draft_tokens, q, p, torch.Generator().manual_seed(seed)).num_accepted == accepted
