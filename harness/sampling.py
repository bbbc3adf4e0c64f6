"""Turning logits into the distribution a token is drawn from.

Both models' logits go through the same shaping (temperature, then top-k,
then top-p), so the draft's q is exactly the distribution its token was
drawn from and the target's p is the distribution speculative decoding
must reproduce. Temperature 0 is not shaped at all: it is the greedy path
(argmax), handled on its own by the loop and the rule.

Probabilities are computed in float32 at least (float64 stays float64), so
half-precision models never do acceptance arithmetic in half precision.
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
    """Shaped distribution over the vocabulary. logits: [..., V] -> probs [..., V].

    Non-finite logits have one fixed meaning, the same for target and draft
    (and so for the baseline): NaN is an impossible token; a row with +inf
    logits puts equal mass on those; a row with no usable logit at all is
    uniform. A NaN never reaches the acceptance arithmetic.
    """
    assert not sampling.greedy, "greedy decoding uses argmax, not probabilities"
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(dtype)
    pos_inf = logits == float("inf")
    logits = torch.where(pos_inf.any(-1, keepdim=True), torch.where(pos_inf, 0.0, float("-inf")), logits)
    logits = torch.where(torch.isnan(logits), float("-inf"), logits) / sampling.temperature
    logits = torch.where((logits > float("-inf")).any(-1, keepdim=True), logits, 0.0)  # nothing usable: uniform
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when
        # the mass strictly before it already reaches top_p (the first always stays).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row, drawn proportionally to non-negative weights [..., V].

    argmax(w / E) with E ~ Exp(1) is an exact draw from w / sum(w) (the
    exponential race), needs no normalisation and, unlike torch.multinomial,
    no host synchronisation on CUDA.
    """
    race = torch.empty_like(weights).exponential_(1.0, generator=generator)
    # An exponential draw of exactly 0 would turn a zero weight into 0/0 = NaN,
    # which argmax picks: clamp so an impossible token can never win.
    race = race.clamp_min(torch.finfo(race.dtype).tiny)
    return (weights / race).argmax(-1)
