"""Drafters: whatever proposes tokens for the target to verify.

Every drafter has the same three verbs, and the loop knows nothing else:
  start(prompt_ids)                       a new sequence begins;
  propose(ids, k, sampling, generator)    up to k tokens after the committed
                                          ids, with the distributions q they
                                          were drawn from;
  rollback(length)                        only the first `length` tokens of
                                          what it has seen are committed.
A drafter may propose fewer than k tokens (prompt lookup finds no match):
the cycle then verifies what there is, down to a plain target step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from harness.models import CachedLM
from harness.sampling import Sampling, sample, shape_probs


class Drafter(Protocol):
    def start(self, prompt_ids: torch.Tensor) -> None: ...

    def propose(
        self, ids: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens [k'], q [k', V] or None when greedy), k' <= k."""
        ...

    def rollback(self, length: int) -> None: ...


class ModelDrafter:
    """A small causal LM drafting autoregressively with its own KV cache.

    Its cache holds a prefix of the committed ids. Each proposal first feeds
    whatever it has not seen (the tokens committed last cycle: one recovered
    token, or the last draft plus the bonus when all were accepted), then
    feeds its own drafts one at a time. The k-th draft is never fed: if it is
    accepted it is caught up next cycle. No host sync happens here.
    """

    def __init__(self, lm: CachedLM):
        self.lm = lm

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.lm.reset()
        self.lm.prefill(prompt_ids[:-1])

    def propose(self, ids, k, sampling, generator):
        tokens, probs = [], []
        feed = ids[self.lm.length :]  # [>= 1] committed tokens not yet cached
        for _ in range(k):
            logits = self.lm.forward(feed, num_logits=1)[0]  # [V]
            if sampling.greedy:
                token = logits.argmax()
            else:
                q = shape_probs(logits, sampling)  # [V]
                token = sample(q, generator)
                probs.append(q)
            tokens.append(token)
            feed = token[None]
        if not tokens:
            return ids.new_empty(0), None
        return torch.stack(tokens), (torch.stack(probs) if probs else None)

    def rollback(self, length: int) -> None:
        self.lm.rollback(length)


class NgramDrafter:
    """Model-free prompt lookup: find the latest earlier occurrence of the
    context's last n tokens (n from max_ngram down to min_ngram) and propose
    the tokens that followed it. Its q is a point mass on each proposal, so
    the rule accepts x with probability p(x) and stays exact."""

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram

    def start(self, prompt_ids: torch.Tensor) -> None:
        pass

    def propose(self, ids, k, sampling, generator):
        tokens = self._lookup(ids, k)
        if tokens.shape[0] == 0 or sampling.greedy:
            return tokens, None
        q = torch.zeros(tokens.shape[0], self.vocab_size, device=ids.device)
        q[torch.arange(tokens.shape[0]), tokens] = 1.0
        return tokens, q

    def _lookup(self, ids: torch.Tensor, k: int) -> torch.Tensor:
        if k == 0:
            return ids.new_empty(0)
        for n in range(min(self.max_ngram, ids.shape[0] - 1), self.min_ngram - 1, -1):
            windows = ids.unfold(0, n, 1)[:-1]  # [len - n, n] every earlier n-gram
            hits = (windows == ids[-n:]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n  # the latest match: most recent context
                return ids[start : start + k]
        return ids.new_empty(0)

    def rollback(self, length: int) -> None:
        pass
