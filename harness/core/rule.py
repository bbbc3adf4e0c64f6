"""The speculative accept / reject rule, as pure functions (Leviathan et al., 2022).

A cycle's k `drafted` tokens x_1..x_k (drawn from the draft's q, `draft_probs`) are checked against the
target's p (`target_probs`): x_i is `accepted` with probability min(1, p_i(x_i) / q_i(x_i)). At the first
rejection a `recovered` token is sampled from norm(max(0, p - q)); when all k are accepted, a `bonus` token
from the target's row k+1 (no extra pass). Each cycle commits accepted + 1 tokens, each distributed exactly
as p. The expected acceptance at a position is beta_i = sum_v min(p_i(v), q_i(v)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from harness.base.host_reads import from_host
from harness.core.sampling import sample_rows


class Verdict(NamedTuple):
    """One row's verdict (`verify`: a sequence alone)."""

    num_accepted: int  # leading drafted tokens kept, 0..k
    next_token: torch.Tensor  # [] the recovered or bonus token
    expected_acceptance: torch.Tensor  # [k] beta_i = sum_v min(p_i, q_i)


class Verdicts(NamedTuple):
    """The verdicts of a batch's rows, on the device: nothing here has been read by the host."""

    accepted: torch.Tensor  # [B] leading drafted tokens kept, 0..counts[i]
    next_token: torch.Tensor  # [B] the recovered or bonus token
    expected_acceptance: torch.Tensor  # [B, K] beta at each drafted position (0 past a row's count)


def verify_rows(
    draft_tokens: torch.Tensor,  # [B, K] drafted tokens, row i's first counts[i] real
    counts: list[int],  # [B] tokens row i drafted
    draft_probs: torch.Tensor | None,  # [B, K, V] q, the laws row i's drafts were drawn from (None: nothing drafted)
    target_probs: torch.Tensor,  # [B, K + 1, V] p; row i's position counts[i] is its bonus row
    generators,  # [B] each row's own random stream
) -> Verdicts:
    """Speculative sampling on every row at once: accept a prefix, then recover or take the bonus. Row i
    draws counts[i] float64 uniforms, then one for its next token, from its own generator (as alone). No host read."""
    B, K = draft_tokens.shape
    device = target_probs.device
    drafted = from_host(counts, device)  # [B]
    valid = torch.arange(K, device=device) < drafted[:, None]  # [B, K]
    if draft_probs is None:  # nothing drafted: every row's next token is its bonus row's (a plain target step)
        assert not any(counts), "drafted tokens need the laws they were drawn from"
        draft_probs = target_probs.new_zeros(B, K, target_probs.shape[-1])
    p_x = target_probs[:, :K].gather(-1, draft_tokens[..., None])[..., 0]  # [B, K]
    q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, K]
    # Accept x_i with probability min(1, p/q): u * q < p for u ~ U[0, 1). Strict '<' so that a
    # token the target gives zero mass is never kept; float64 u, as a float32 u (multiples of
    # 2^-24) would accept a p/q below 6e-8 at 6e-8. Past a row's drafts: never accepted.
    u = torch.ones(B, K, dtype=torch.float64, device=device)
    for i, (g, c) in enumerate(zip(generators, counts)):
        if c:
            u[i, :c] = torch.rand(c, generator=g, device=device, dtype=torch.float64)
    accepted = (u * q_x < p_x) & valid  # [B, K]
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(B, device=device)
    p = target_probs[rows, num_accepted]  # [B, V] the first rejected position's row, or the bonus row
    rejected = (num_accepted < drafted)[:, None]  # [B, 1]; at the bonus row q is 0
    q = draft_probs[rows, num_accepted.clamp(max=max(K - 1, 0))] * rejected if K else torch.zeros_like(p)  # [B, V]
    residual = (p - q).clamp_min(0)  # [B, V] unnormalised
    # If rounding leaves no residual mass, p <= q everywhere means p == q up to rounding,
    # where rejection has probability zero: fall back to p.
    weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    expected = torch.minimum(target_probs[:, :K], draft_probs).sum(-1) * valid  # [B, K]
    return Verdicts(num_accepted, sample_rows(weights, generators), expected)


def greedy_rows(
    draft_tokens: torch.Tensor,  # [B, K]
    counts: list[int],  # [B]
    target_argmax: torch.Tensor,  # [B, K + 1] the target's greedy token at each position
) -> Verdicts:
    """Temperature 0: keep drafted tokens while they equal the target's argmax; the next token is
    the target's argmax at the first mismatch (or the bonus row). No host read."""
    K, device = draft_tokens.shape[1], draft_tokens.device
    matches = draft_tokens == target_argmax[:, :K]  # [B, K]
    if min(counts, default=K) < K:  # a row drafted fewer: its positions past them are never accepted
        matches &= torch.arange(K, device=device) < from_host(counts, device)[:, None]
    num_accepted = matches.long().cumprod(-1).sum(-1)  # [B]
    return Verdicts(num_accepted, target_argmax.gather(1, num_accepted[:, None])[:, 0], matches.to(torch.float32))


def verify(
    draft_tokens: torch.Tensor,  # [k] drafted tokens x_1..x_k
    draft_probs: torch.Tensor,  # [k, V] q_i, the distributions x_i were drawn from
    target_probs: torch.Tensor,  # [k + 1, V] p_i; row k is the bonus row
    generator: torch.Generator,
) -> Verdict:
    """`verify_rows` for one sequence alone (its accepted count read by the host)."""
    k = draft_tokens.shape[0]
    v = verify_rows(draft_tokens[None], [k], draft_probs[None], target_probs[None], [generator])
    return Verdict(int(v.accepted[0]), v.next_token[0], v.expected_acceptance[0])
