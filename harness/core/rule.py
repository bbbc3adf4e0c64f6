"""The speculative accept / reject rule, as pure functions.

Vocabulary, used everywhere in the harness:
  drafted   the k tokens the draft proposed in a cycle, x_1..x_k;
  accepted  the leading drafted tokens the rule keeps (0..k of them);
  recovered the token sampled at the first rejected position from the
            residual norm(max(0, p - q));
  bonus     the token sampled from the target's row k+1 when all k drafted
            tokens are accepted; it costs no extra target pass.
Each cycle commits accepted + 1 tokens: accepted drafts, then either the
recovered or the bonus token.

Notation follows Leviathan et al. (2022): p is the target's (shaped)
distribution, q the draft's. In code they are `target_probs` and
`draft_probs`. Drafted token x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); the committed token at every position is then
distributed exactly as p. The expected acceptance at a position is
beta_i = sum_v min(p_i(v), q_i(v)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from harness.core.sampling import sample


class Verdict(NamedTuple):
    num_accepted: int  # leading drafted tokens kept, 0..k
    next_token: torch.Tensor  # [] the recovered or bonus token
    expected_acceptance: torch.Tensor  # [k] beta_i = sum_v min(p_i, q_i)


def verify(
    draft_tokens: torch.Tensor,  # [k] drafted tokens x_1..x_k
    draft_probs: torch.Tensor,  # [k, V] q_i, the distributions x_i were drawn from
    target_probs: torch.Tensor,  # [k + 1, V] p_i; row k is the bonus row
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling: accept a prefix, then recover or take the bonus."""
    k = draft_tokens.shape[0]
    positions = torch.arange(k, device=draft_tokens.device)
    p_x = target_probs[positions, draft_tokens]  # [k]
    q_x = draft_probs[positions, draft_tokens]  # [k]
    # Accept x_i with probability min(1, p/q): u * q < p for u ~ U[0, 1).
    # Strict '<' so that a token the target gives zero mass is never kept. u is
    # float64: a float32 u (multiples of 2^-24) would accept a p/q below 6e-8 at 6e-8.
    u = torch.rand(k, generator=generator, device=p_x.device, dtype=torch.float64)
    accepted = u * q_x < p_x  # [k]
    num_accepted = int(accepted.cumprod(0).sum())  # host sync: the one the rule needs
    if num_accepted < k:
        p, q = target_probs[num_accepted], draft_probs[num_accepted]
        residual = (p - q).clamp_min(0)  # [V], unnormalised: sample() needs no norm
        # If rounding leaves no residual mass, p <= q everywhere means p == q up
        # to rounding, where rejection has probability zero: fall back to p.
        weights = torch.where(residual.sum() > 0, residual, p)
    else:
        weights = target_probs[k]  # the bonus row
    expected = torch.minimum(target_probs[:k], draft_probs).sum(-1)  # [k]
    return Verdict(num_accepted, sample(weights, generator), expected)


def verify_greedy(
    draft_tokens: torch.Tensor,  # [k]
    target_argmax: torch.Tensor,  # [k + 1] the target's greedy token at each row
) -> Verdict:
    """Temperature 0: keep drafted tokens while they equal the target's argmax;
    the next token is the target's argmax at the first mismatch (or the bonus row)."""
    k = draft_tokens.shape[0]
    matches = draft_tokens == target_argmax[:k]  # [k]
    num_accepted = int(matches.cumprod(0).sum())  # host sync
    return Verdict(num_accepted, target_argmax[num_accepted], matches.to(torch.float32))
