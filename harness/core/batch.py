"""The speculative loop and the baseline over a batch of sequences (batch_size > 1).

The same cycle as harness.core.loop, for B rows at once: one draft proposal per row, one verify pass
of the target over every row (a ragged step: row i feeds its unseen tokens and its k'_i drafts), then
the rule of harness.core.rule applied to each row on its own, with that row's own generator, and each
row's caches rolled back to its own committed length. Rows accept different numbers of drafts and
commit different numbers of tokens; a row that hits EOS or its token budget leaves the batch at the
end of that cycle, and the passes after it run only the rows still decoding (harness.models.batched).

Every row's law is therefore the one-sequence law: its drafts depend only on its own committed
tokens, its target rows are those of its own tokens alone, and every random draw of its cycle (the
draft's samples, the acceptance coins, the recovered or bonus token) comes from its own generator.

The baseline decodes the same rows one token per step, each sampled with its row's generator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from harness.core.loop import Cycle, commit
from harness.core.rule import verify, verify_greedy
from harness.core.sampling import Sampling, sample, shape_probs
from harness.models.batched import BatchedLM


def speculative_decode_batch(
    target: BatchedLM,
    drafter,  # a batch drafter (harness.core.batch_drafters)
    prompts: Sequence[torch.Tensor],  # B x [T_i] on the target's device
    k: int,
    sampling: Sampling,
    max_new_tokens: int,
    eos_ids: set[int],
    generators: Sequence[torch.Generator],  # one per row
    rule=verify,
) -> Iterator[list[tuple[int, Cycle]]]:
    """Per cycle, (row, its Cycle) for every row that took part in it."""
    target.start(len(prompts))
    drafter.start(prompts)
    reads = getattr(drafter, "reads_target", ())  # feature heads' target layers: only they cost a capture
    ids = list(prompts)  # per row: committed so far
    generated = [0] * len(prompts)
    active = list(range(len(prompts)))  # rows still decoding, in the order the batch holds them
    while active:
        gens = [generators[r] for r in active]
        budgets = [min(k, max_new_tokens - generated[r] - 1) for r in active]
        proposals = drafter.propose([ids[r] for r in active], budgets, sampling, gens)  # per row ([k'], [k', V] | None)
        unseen = [ids[r][n:] for r, n in zip(active, target.lengths)]
        feeds = [torch.cat([u, tokens]) for u, (tokens, _) in zip(unseen, proposals)]
        wanted = [tokens.shape[0] + 1 for tokens, _ in proposals]
        if reads:
            logits, features = target.forward_features(feeds, wanted, reads)  # per row [k'+1, V], [u + k', F]
        else:
            logits = target.forward(feeds, wanted)  # per row [k'+1, V]
        cycles, lengths, finished, seen = [], [], [], []
        for i, (r, (tokens, q), rows, gen) in enumerate(zip(active, proposals, logits, gens)):
            if sampling.greedy:
                verdict = verify_greedy(tokens, rows.argmax(-1))
            else:
                p = shape_probs(rows, sampling)  # [k'+1, V]
                verdict = rule(tokens, p[:0] if q is None else q, p, gen)
            n = verdict.num_accepted
            lengths.append(ids[r].shape[0] + n)
            if reads:  # the features of the committed positions the target has now read: the unseen and the n accepted
                seen.append((features[i][: unseen[i].shape[0] + n], ids[r].shape[0] - unseen[i].shape[0]))
            cycle, committed, stop = commit(tokens, verdict, eos_ids, max_new_tokens - generated[r])
            ids[r] = torch.cat([ids[r], committed])
            generated[r] += len(cycle.tokens)
            cycles.append((r, cycle))
            if stop:
                finished.append(i)
        target.rollback(lengths)
        drafter.rollback(lengths)
        if reads:
            drafter.observe(seen)
        yield cycles
        if finished:
            going = [i for i in range(len(active)) if i not in finished]
            target.keep(going)
            drafter.keep(going)
            active = [active[i] for i in going]


def autoregressive_decode_batch(
    target: BatchedLM,
    prompts: Sequence[torch.Tensor],
    sampling: Sampling,
    max_new_tokens: int,
    eos_ids: set[int],
    generators: Sequence[torch.Generator],
) -> Iterator[list[tuple[int, int]]]:
    """Target-only decoding of B rows, one token per row per step: per step, (row, token) for every
    row still decoding. As harness.core.loop.autoregressive_decode, the prompts' pass gives the first tokens."""
    target.start(len(prompts))
    logits = [rows[0] for rows in target.forward(list(prompts), [1] * len(prompts))]  # per row [V]
    active = list(range(len(prompts)))
    for step in range(max_new_tokens):
        if sampling.greedy:
            tokens = [row.argmax() for row in logits]
        else:
            probs = shape_probs(torch.stack(logits), sampling)  # [B', V]
            tokens = [sample(p, generators[r]) for p, r in zip(probs, active)]
        token_ids = [int(t) for t in tokens]  # host sync: the stop check needs them
        yield list(zip(active, token_ids))
        going = [i for i, t in enumerate(token_ids) if t not in eos_ids and step < max_new_tokens - 1]
        if not going:
            return
        if len(going) < len(active):
            target.keep(going)
            active = [active[i] for i in going]
        logits = [rows[0] for rows in target.forward([tokens[i][None] for i in going], [1] * len(going))]
