"""Turning logits into the distribution a token is drawn from.

Both models' logits go through the same shaping (temperature, then top-k, then top-p), so q is exactly
the law a draft was drawn from and p the law to reproduce. Temperature 0 is greedy (argmax), never shaped.
Probabilities are float32 at least, so half-precision models never do acceptance arithmetic in half precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How committed tokens are chosen. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def shape_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Shaped distribution over the vocabulary. logits: [..., V] -> probs [..., V]. Non-finite logits mean
    the same for every model: NaN is an impossible token; a row with +inf logits puts equal mass on those;
    a row with no usable logit is uniform. A NaN never reaches the acceptance arithmetic."""
    assert not sampling.greedy, "greedy decoding uses argmax, not probabilities"
    dtype = torch.promote_types(logits.dtype, torch.float32)
    inf = float("inf")
    logits = logits.to(dtype).nan_to_num(nan=-inf, posinf=inf, neginf=-inf)  # NaN: impossible
    # Shift by the row max: inf - inf is NaN, and NaN -> 0 gives +inf entries of a +inf row its mass (the
    # rest is -inf) and a row with nothing above -inf all 0 (uniform). Elementwise only: no host sync.
    logits = (logits - logits.amax(-1, keepdim=True)).nan_to_num(nan=0.0, posinf=inf, neginf=-inf)
    logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < nucleus_floor(probs, sampling.top_p), float("-inf"))
    return logits.softmax(-1)


# Candidate counts tried on a CPU before sorting the whole vocabulary (a 49k-token sort: ~2 ms a row; most
# nuclei are small). On CUDA the sort is cheap and a rung would cost a host sync. Each rung gives the same floor.
NUCLEUS_CANDIDATES = (256, 2048)


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest probability top-p keeps. probs [..., V] -> floor [..., 1]. The nucleus: the most probable
    tokens while the mass before each is below top_p, plus ties of its last one (never sort-order dependent)."""
    rows = probs.reshape(-1, probs.shape[-1])  # [R, V]
    vocab = rows.shape[-1]
    floor = torch.empty_like(rows[:, :1])  # [R, 1]
    todo = ...  # the rows whose nucleus may lie beyond the candidates tried: all (no copy), then their indices
    ladder = [n for n in NUCLEUS_CANDIDATES if n < vocab] if rows.device.type == "cpu" else []
    for n in [*ladder, vocab]:
        top = torch.topk(rows[todo], n).values if n < vocab else rows[todo].sort(descending=True).values  # [R', n]
        mass = top.cumsum(-1)  # [R', n]
        # The mass before each token, as the previous cumulative sum: the same at every rung (mass - top
        # can round one ulp lower). The first token always stays, even when top_p rounds to 0.
        before = torch.nn.functional.pad(mass[:, :-1], (1, 0))  # [R', n]
        kept = (before < top_p).sum(-1, keepdim=True).clamp_min(1)  # [R', 1]
        floor[todo] = top.gather(-1, kept - 1)
        if n < vocab:  # CPU only: the host reads which rows the n candidates did not settle
            todo = torch.arange(rows.shape[0])[todo][mass[:, -1] < top_p]
            if todo.numel() == 0:
                break
    return floor.reshape(*probs.shape[:-1], 1)


def sample(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row, drawn proportionally to non-negative weights [..., V], every row from `generator`.
    Inverse CDF: a float64 cumulative sum and one uniform per row; unlike torch.multinomial, no host sync."""
    u = torch.rand(weights.shape[:-1] + (1,), generator=generator, device=weights.device, dtype=torch.float64)  # [..., 1]
    return _located(weights, u)


def sample_rows(weights: torch.Tensor, generators) -> torch.Tensor:
    """One index per row of weights [B, V], row i drawn with generators[i] (its own stream, one uniform
    each, as `sample` draws it alone): [B]."""
    u = torch.cat([torch.rand(1, generator=g, device=weights.device, dtype=torch.float64) for g in generators])[:, None]  # [B, 1]
    return _located(weights, u)


def _located(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index each row's float64 uniform u [..., 1] (in [0, 1)) lands on in its weights' float64 cumulative sum [..., V]."""
    cdf = weights.to(torch.float64).cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    u = u * total
    # Strictly below the total: a zero weight can never be drawn, not even at u -> 1.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[..., 0]
