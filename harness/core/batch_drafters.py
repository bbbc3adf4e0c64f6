"""Drafters for a batch of rows (harness.core.batch): the verbs of harness.core.drafters, per row.

  start(prompts)                           B new sequences;
  propose(ids, budgets, sampling, gens)    per active row i, up to budgets[i] tokens after ids[i] and
                                           the q they were drawn from, with row i's generator;
  rollback(lengths)                        per active row, its committed length;
  keep(rows)                               only these active rows go on.

A draft model drafts every row in one pass per step (`BatchModelDrafter`, on a BatchedLM); prompt
lookup runs one NgramDrafter per row (`RowDrafters`): it has no model to batch.
"""

from __future__ import annotations

import copy

import torch

from harness.core.drafters import draw, stacked
from harness.models.batched import BatchedLM


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
    """One copy of a one-sequence drafter per row, each with its own state: prompt lookup (no model to
    batch), and a feature head (a head pass per row: its own KV storage, `FeatureDrafter.fresh`), which
    is handed each row's features of the batched verify pass (`observe`)."""

    def __init__(self, drafter):
        self.drafter = drafter  # the pattern: settings (and costs, for cost-aware lookup) shared, state per copy
        self.reads_target = getattr(drafter, "reads_target", ())
        self.rows: list = []

    def start(self, prompts) -> None:
        fresh = getattr(self.drafter, "fresh", None) or (lambda: copy.copy(self.drafter))
        self.rows = [fresh() for _ in prompts]
        for row, prompt in zip(self.rows, prompts):
            row.start(prompt)

    def propose(self, ids, budgets, sampling, generators):
        return [row.propose(i, b, sampling, g) for row, i, b, g in zip(self.rows, ids, budgets, generators)]

    def rollback(self, lengths) -> None:
        for row, length in zip(self.rows, lengths):
            row.rollback(length)

    def observe(self, seen) -> None:
        """Per active row, (features [n, F] of committed positions start.., start): FeatureDrafter.observe."""
        for row, (features, start) in zip(self.rows, seen):
            row.observe(features, start)

    def keep(self, rows) -> None:
        self.rows = [self.rows[i] for i in rows]
