"""The one speculative loop, and the target-only baseline it is measured against.

Both are generators: the benchmark times each `next()` from outside, so the
algorithm carries no timing code. Both drive the same CachedLM wrapper and
the same sampler, so the only difference between them is speculation.

Cache invariant (both models): the cache holds every committed token but
the last; the next forward feeds that last token, whose logits give the
distribution of the token after it. A cycle therefore feeds the target
[last committed, x_1..x_k] and gets k + 1 rows: row i scores x_{i+1}, and
row k is the bonus row. Rolling back is cropping both caches to the
committed length minus one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from harness.drafters import Drafter
from harness.models import CachedLM
from harness.rule import Verdict, verify, verify_greedy
from harness.sampling import Sampling, sample, shape_probs


@dataclass
class Cycle:
    """One draft / verify cycle, as committed."""

    tokens: list[int]  # committed this cycle (accepted drafts + recovered/bonus), after stops
    num_drafted: int  # k' <= k
    num_accepted: int  # leading drafted tokens accepted, 0..k'
    expected_acceptance: torch.Tensor  # [min(num_accepted + 1, k')] beta at each tested position


def speculative_decode(
    target: CachedLM,
    drafter: Drafter,
    prompt_ids: torch.Tensor,  # [T] on the target's device
    k: int,
    sampling: Sampling,
    max_new_tokens: int,
    eos_ids: set[int],
    generator: torch.Generator,
    rule=verify,  # tests swap in deliberately broken rules; users cannot
) -> Iterator[Cycle]:
    target.reset()
    target.prefill(prompt_ids[:-1])
    drafter.start(prompt_ids)
    ids = prompt_ids  # [L] committed so far
    generated = 0
    while generated < max_new_tokens:
        # A cycle commits at most k' + 1 tokens: draft no more than can be kept.
        k_cycle = min(k, max_new_tokens - generated - 1)
        draft_tokens, draft_probs = drafter.propose(ids, k_cycle, sampling, generator)  # [k'], [k', V]
        k_cycle = draft_tokens.shape[0]
        cached = target.length  # == len(ids) - 1
        logits = target.forward(torch.cat([ids[-1:], draft_tokens]), num_logits=k_cycle + 1)  # [k'+1, V]
        if sampling.greedy:
            verdict: Verdict = verify_greedy(draft_tokens, logits.argmax(-1))
        else:
            target_probs = shape_probs(logits, sampling)  # [k'+1, V]
            if draft_probs is None:  # nothing drafted (k' = 0): a plain target step
                draft_probs = target_probs[:0]
            verdict = rule(draft_tokens, draft_probs, target_probs, generator)
        n = verdict.num_accepted
        target.rollback(cached + 1 + n)
        drafter.rollback(ids.shape[0] + n)
        committed = torch.cat([draft_tokens[:n], verdict.next_token[None]])  # [n + 1]
        kept, stop = _apply_stops(committed.tolist(), eos_ids, max_new_tokens - generated)
        ids = torch.cat([ids, committed[: len(kept)]])
        generated += len(kept)
        yield Cycle(kept, k_cycle, n, verdict.expected_acceptance[: min(n + 1, k_cycle)])
        if stop:
            return


def autoregressive_decode(
    target: CachedLM,
    prompt_ids: torch.Tensor,  # [T]
    sampling: Sampling,
    max_new_tokens: int,
    eos_ids: set[int],
    generator: torch.Generator,
) -> Iterator[int]:
    """Target-only decoding, one token per step: the baseline."""
    target.reset()
    target.prefill(prompt_ids[:-1])
    last = prompt_ids[-1:]  # [1]
    for _ in range(max_new_tokens):
        logits = target.forward(last, num_logits=1)[0]  # [V]
        token = logits.argmax() if sampling.greedy else sample(shape_probs(logits, sampling), generator)
        token_id = int(token)  # host sync: the stop check needs it
        yield token_id
        if token_id in eos_ids:
            return
        last = token[None]


def _apply_stops(tokens: list[int], eos_ids: set[int], budget: int) -> tuple[list[int], bool]:
    """Cut a cycle's tokens at the first EOS (kept) or at the token budget."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos_ids:
            return tokens[: i + 1], True
    return tokens[:budget], len(tokens) >= budget
