"""The one speculative loop, and the target-only baseline it is measured against.

Both are generators: the benchmark times each `next()` from outside, so the
algorithm carries no timing code. Both drive the same CachedLM wrapper and
the same sampler, so the only difference between them is speculation.

Cache invariant (both models): after a cycle the cache holds every
committed token but the last; the next forward feeds that last token, whose
logits give the distribution of the token after it. A cycle therefore feeds
the target [last committed, x_1..x_k] and gets k + 1 rows: row i scores
x_{i+1}, and row k is the bonus row. The first cycle feeds the whole prompt
before x_1..x_k, so the prompt's prefill and the first verify are one pass
(as in HF's assisted generation). Rolling back is cropping both caches to
the committed length minus one.

A feature head (harness.core.drafters.FeatureDrafter) reads the target's hidden states: the verify
pass captures the layers it names, and after the rollback the drafter is handed those of the
committed positions only (the unseen tokens and the accepted drafts), on the device. Its first
cycle drafts nothing, since the target has not read the prompt yet.

Host synchronisation (what a CUDA device waits for): drafting, shaping,
sampling and verifying are all device ops, so the draft's k forwards are
queued without waiting. Per cycle the host reads back two things it must
branch on: the number of accepted tokens (in the rule: it decides the
rollback lengths) and the committed token ids (below: EOS and the token
budget decide whether to stop). The baseline reads back each token for the
same stop check. tests/test_host_syncs.py holds the loop to this on any
device (harness.core.host_syncs.HostReads); `python -m harness.bench` reports the
reads per cycle by source line, and on CUDA the device's own count too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.core.drafters import Drafter
from harness.core.rule import Verdict, verify, verify_greedy
from harness.core.sampling import Sampling, sample, shape_probs
from harness.models.cached import CachedLM


@dataclass
class Cycle:
    """One draft / verify cycle, as committed."""

    tokens: list[int]  # committed this cycle (accepted drafts + recovered/bonus), after stops
    num_drafted: int  # k' <= k
    num_accepted: int  # leading drafted tokens accepted and kept, 0..k' (an EOS among them ends the cycle)
    expected_acceptance: torch.Tensor  # [tested positions] beta at each: up to the first rejection, or the EOS
    num_after_eos: int = 0  # drafted tokens after an accepted EOS: never to be kept, so neither accepted nor rejected


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
    target.reset()  # the first cycle's verify pass is also the prompt's prefill
    drafter.start(prompt_ids)
    reads = getattr(drafter, "reads_target", ())  # a feature head's target layers (Drafter): only it costs a capture
    ids = prompt_ids  # [L] committed so far
    generated = 0
    while generated < max_new_tokens:
        # A cycle commits at most k' + 1 tokens: draft no more than can be kept.
        k_cycle = min(k, max_new_tokens - generated - 1)
        draft_tokens, draft_probs = drafter.propose(ids, k_cycle, sampling, generator)  # [k'], [k', V]
        k_cycle = draft_tokens.shape[0]
        unseen = ids[target.length :]  # the whole prompt in the first cycle, then the last committed token
        fed = torch.cat([unseen, draft_tokens])  # [u + k']
        if reads:
            logits, features = target.forward_features(fed, k_cycle + 1, reads)  # [k'+1, V], [u + k', F]
        else:
            logits = target.forward(fed, num_logits=k_cycle + 1)  # [k'+1, V]
        if sampling.greedy:
            verdict: Verdict = verify_greedy(draft_tokens, logits.argmax(-1))
        else:
            target_probs = shape_probs(logits, sampling)  # [k'+1, V]
            if draft_probs is None:  # nothing drafted (k' = 0): a plain target step
                draft_probs = target_probs[:0]
            verdict = rule(draft_tokens, draft_probs, target_probs, generator)
        n = verdict.num_accepted
        target.rollback(ids.shape[0] + n)  # keep ids and the n accepted drafts; the next token is fed next cycle
        drafter.rollback(ids.shape[0] + n)
        if reads:  # the features of the committed positions the target has now read: the unseen and the n accepted
            drafter.observe(features[: unseen.shape[0] + n], ids.shape[0] - unseen.shape[0])
        cycle, committed, stop = commit(draft_tokens, verdict, eos_ids, max_new_tokens - generated)
        ids = torch.cat([ids, committed])
        generated += len(cycle.tokens)
        yield cycle
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
    """Target-only decoding, one token per step: the baseline. Like HF's
    generate(), the prompt's forward pass also gives the first token's row,
    so n tokens cost one prefill and n - 1 one-token steps."""
    target.reset(rollback=False)
    logits = target.prefill(prompt_ids)  # [V] the row after the whole prompt
    for step in range(max_new_tokens):
        token = logits.argmax() if sampling.greedy else sample(shape_probs(logits, sampling), generator)
        token_id = int(token)  # host sync: the stop check needs it
        yield token_id
        if token_id in eos_ids or step == max_new_tokens - 1:
            return
        logits = target.forward(token[None], num_logits=1)[0]  # [V]


def commit(draft_tokens: torch.Tensor, verdict: Verdict, eos_ids: set[int], budget: int) -> tuple[Cycle, torch.Tensor, bool]:
    """A verdict on drafts [k'] as a Cycle, the committed tokens [<= n + 1] to append (the accepted drafts
    and the recovered or bonus token, cut at the first EOS or the token budget), and whether decoding stops."""
    n, k = verdict.num_accepted, draft_tokens.shape[0]
    committed = torch.cat([draft_tokens[:n], verdict.next_token[None]])  # [n + 1]
    kept, stop = apply_stops(committed.tolist(), eos_ids, budget)
    # Positions after an EOS among the accepted drafts were never going to be kept: not tested.
    accepted, tested = (n, min(n + 1, k)) if len(kept) > n else (len(kept), len(kept))
    cycle = Cycle(kept, k, accepted, verdict.expected_acceptance[:tested], k - accepted if len(kept) <= n else 0)
    return cycle, committed[: len(kept)], stop


def apply_stops(tokens: list[int], eos_ids: set[int], budget: int) -> tuple[list[int], bool]:
    """Cut a cycle's tokens at the first EOS (kept) or at the token budget."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos_ids:
            return tokens[: i + 1], True
    return tokens[:budget], len(tokens) >= budget
