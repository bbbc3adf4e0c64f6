"""Drafters for a batch of rows (harness.core.batch): the verbs of harness.core.drafters, per row.

  start(prompts)                           B new sequences;
  propose(ids, budgets, sampling, gens)    per active row i, up to budgets[i] tokens after ids[i] and
                                           the q they were drawn from, with row i's generator;
  rollback(lengths)                        per active row, its committed length;
  keep(rows)                               only these active rows go on.

A draft model drafts every row in one pass per step (`BatchModelDrafter`, on a BatchedLM), and so
does a feature head (`BatchFeatureDrafter`, on harness.models.eagle.HeadRows), which is also handed
each row's features of the batched verify pass (`observe`); prompt lookup runs one NgramDrafter per
row (`RowDrafters`): it has no model to batch.
"""

from __future__ import annotations

import copy

import torch

from harness.core.drafters import draw, kept_features, stacked
from harness.models.batched import BatchedLM
from harness.models.eagle import HeadRows


class BatchModelDrafter:
    """harness.core.drafters.ModelDrafter for B rows: each step feeds every row still drafting one token
    (its unseen committed tokens first), in one pass; a row drafts budgets[i] tokens and never feeds its last."""

    def __init__(self, lm: BatchedLM):
        self.lm = lm

    def start(self, prompts) -> None:
        self.lm.start(len(prompts))
        self.lm.forward([p[:-1] for p in prompts], [0] * len(prompts))

    def propose(self, ids, budgets, sampling, generators):
        tokens: list[list[torch.Tensor]] = [[] for _ in ids]
        probs: list[list[torch.Tensor]] = [[] for _ in ids]
        feeds = [row[n:] if b else row[:0] for row, n, b in zip(ids, self.lm.lengths, budgets)]
        for step in range(max(budgets, default=0)):
            drafting = [b > step for b in budgets]
            logits = self.lm.forward(feeds, [int(d) for d in drafting])  # per row [1 or 0, V]
            for i, (rows, d) in enumerate(zip(logits, drafting)):
                if d:
                    tokens[i].append(draw(rows[0], sampling, generators[i], probs[i]))
            feeds = [tokens[i][-1][None] if b > step + 1 else ids[i][:0] for i, b in enumerate(budgets)]
        return [stacked(row, t, q) for row, t, q in zip(ids, tokens, probs)]

    def rollback(self, lengths) -> None:
        self.lm.rollback(lengths)

    def keep(self, rows) -> None:
        self.lm.keep(rows)


class RowDrafters:
    """One copy of a one-sequence drafter per row (prompt lookup), each with its own state."""

    def __init__(self, drafter):
        self.drafter = drafter  # the pattern: settings (and costs, for cost-aware lookup) shared, state per copy
        self.rows: list = []

    def start(self, prompts) -> None:
        self.rows = [copy.copy(self.drafter) for _ in prompts]
        for row, prompt in zip(self.rows, prompts):
            row.start(prompt)

    def propose(self, ids, budgets, sampling, generators):
        return [row.propose(i, b, sampling, g) for row, i, b, g in zip(self.rows, ids, budgets, generators)]

    def rollback(self, lengths) -> None:
        for row, length in zip(self.rows, lengths):
            row.rollback(length)

    def keep(self, rows) -> None:
        self.rows = [self.rows[i] for i in rows]


class BatchFeatureDrafter:
    """harness.core.drafters.FeatureDrafter for B rows, the head's passes batched (HeadRows): the first
    step feeds each row its unseen pairs (ragged), each later step one pair per row still drafting.
    Per row, as FeatureDrafter: the committed positions' features, and the pairs built on them."""

    def __init__(self, head):
        self.head = head
        self.reads_target = tuple(head.reads)
        self.rows: HeadRows | None = None
        self.capacity = 0

    def reserve(self, positions: int) -> None:
        self.capacity = max(self.capacity, positions)

    def start(self, prompts) -> None:
        if self.rows is None or self.rows.rows != len(prompts):
            self.rows = HeadRows(self.head, len(prompts), self.capacity)
        self.rows.lengths = [0] * len(prompts)
        self.features: list[torch.Tensor | None] = [None] * len(prompts)
        self.known = [0] * len(prompts)
        self.pairs = [0] * len(prompts)

    def observe(self, seen) -> None:
        """Per active row, (features [n, F] of committed positions start.., start): FeatureDrafter.observe."""
        for i, (features, start) in enumerate(seen):
            self.features[i], self.known[i] = kept_features(self.features[i], self.known[i], features, start)

    def propose(self, ids, budgets, sampling, generators):
        lengths = [row.shape[0] for row in ids]
        drafting = [b > 0 and n >= 2 and known >= n - 1 for b, n, known in zip(budgets, lengths, self.known)]
        tokens: list[list[torch.Tensor]] = [[] for _ in ids]
        probs: list[list[torch.Tensor]] = [[] for _ in ids]
        if any(drafting):
            starts = self.rows.lengths
            counts = [n - 1 - s if d else 0 for n, s, d in zip(lengths, starts, drafting)]
            width = max(counts)
            feed = ids[0].new_zeros(len(ids), width)  # [B, T]
            hidden = self.features[drafting.index(True)].new_zeros(len(ids), width, self.features[drafting.index(True)].shape[1])
            for i, (c, s) in enumerate(zip(counts, starts)):
                if c:
                    feed[i, :c], hidden[i, :c] = ids[i][s + 1 : s + 1 + c], self.features[i][s : s + c]
            logits, out = self.rows.step(feed, hidden, counts, from_target=True)  # [B, V], [B, T, H]
            last = out[torch.arange(len(ids)), torch.tensor([max(c, 1) - 1 for c in counts])]  # [B, H]
            self.pairs = [n - 1 if d else p for n, d, p in zip(lengths, drafting, self.pairs)]
            steps = max(b for b, d in zip(budgets, drafting) if d)
            for j in range(steps):
                drawn = [
                    draw(logits[i], sampling, generators[i], probs[i]) if d and budgets[i] > j else None
                    for i, d in enumerate(drafting)
                ]
                for i, token in enumerate(drawn):
                    if token is not None:
                        tokens[i].append(token)
                going = [token is not None and budgets[i] > j + 1 for i, token in enumerate(drawn)]
                if not any(going):
                    break
                step_feed = torch.stack([t if t is not None else feed.new_zeros(()) for t in drawn])[:, None]  # [B, 1]
                logits, out = self.rows.step(step_feed, last[:, None], [int(g) for g in going], from_target=False)
                last = out[:, 0]
        return [stacked(row, t, q) for row, t, q in zip(ids, tokens, probs)]

    def rollback(self, lengths) -> None:
        self.rows.lengths = [min(n, p, length - 1) for n, p, length in zip(self.rows.lengths, self.pairs, lengths)]

    def keep(self, rows) -> None:
        self.rows.keep_rows(rows)
        self.features = [self.features[i] for i in rows]
        self.known = [self.known[i] for i in rows]
        self.pairs = [self.pairs[i] for i in rows]
