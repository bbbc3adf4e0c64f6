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

A drafter that reads the target (a feature head) also names the target
layers it reads (`reads_target`) and is handed their hidden states at the
committed positions after each verify (`observe`); the others have neither.
"""

from __future__ import annotations

from typing import Protocol

import torch

from harness.config.settings import LOOKUP_LENGTHS
from harness.core.sampling import Sampling, sample, shape_probs
from harness.models.cached import CachedLM


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
            token = draw(logits, sampling, generator, probs)
            tokens.append(token)
            feed = token[None]
        return stacked(ids, tokens, probs)

    def rollback(self, length: int) -> None:
        self.lm.rollback(length)


def draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator, probs: list) -> torch.Tensor:
    """One draft token from logits [V]: the argmax when greedy, else a sample from q, which joins `probs`."""
    if sampling.greedy:
        return logits.argmax()
    q = shape_probs(logits, sampling)  # [V]
    probs.append(q)
    return sample(q, generator)


def stacked(ids: torch.Tensor, tokens: list, probs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A proposal's (tokens [k'], q [k', V] or None) from the drawn tokens."""
    if not tokens:
        return ids.new_empty(0), None
    return torch.stack(tokens), (torch.stack(probs) if probs else None)


class FeatureDrafter:
    """A feature head (harness.models.eagle.FeatureHead) drafting from the target's hidden states.

    Pair i of the head reads the target's feature at position i and the committed token i + 1. After
    a verify the loop hands over the features of the committed positions (`observe`): with L tokens
    committed, those of positions 0..L-2, the last one having been fed with the next verify. A
    proposal first feeds the head the pairs it has not seen, up to pair L-2 (their last output
    scores the first draft), then feeds its own output and each draft, one at a time. Only pairs
    built on the target's features stay in its cache: `rollback` drops the drafted ones, whatever
    was accepted, so that accepted drafts are read again next cycle with the target's features.
    The first cycle drafts nothing: the target has not read the prompt yet. No host sync happens here.
    """

    def __init__(self, head):
        self.head = head
        self.reads_target = tuple(head.reads)  # the target layers whose features it reads (CachedLM.forward_features)
        self.features: torch.Tensor | None = None  # [capacity, F] the committed positions' features, 0..known-1
        self.known = 0
        self.pairs = 0  # pairs in the head's cache built on the target's features

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.head.reset()
        self.known = self.pairs = 0

    def observe(self, features: torch.Tensor, start: int) -> None:
        """The features [n, F] of committed positions start..start+n-1 (the target's cache held `start`)."""
        self.features, self.known = kept_features(self.features, self.known, features, start)

    def propose(self, ids, k, sampling, generator):
        L = ids.shape[0]
        if k == 0 or L < 2 or self.known < L - 1:  # no feature of the last pair yet (the first cycle)
            return ids.new_empty(0), None
        start = self.head.length  # == self.pairs after a rollback
        logits, out = self.head.step(ids[start + 1 : L], self.features[start : L - 1], from_target=True)  # [V], [n, H]
        self.pairs = L - 1
        tokens, probs = [], []
        for j in range(k):
            token = draw(logits, sampling, generator, probs)
            tokens.append(token)
            if j + 1 < k:
                logits, out = self.head.step(token[None], out[-1:], from_target=False)
        return stacked(ids, tokens, probs)

    def rollback(self, length: int) -> None:
        self.head.crop(min(self.pairs, length - 1))


def kept_features(store: torch.Tensor | None, known: int, features: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
    """A feature head's store [capacity, F] of committed positions' features (the first `known` of them
    valid) with features [n, F] of positions start..start+n-1 written in, grown as needed; and the new count."""
    if start > known:  # a target that kept a prefix it read before this sequence began
        raise RuntimeError(f"a feature head needs the target to read every position: features from {start}, known to {known}")
    end = start + features.shape[0]
    if store is None or end > store.shape[0]:
        grown = features.new_empty(max(end, 2 * (0 if store is None else store.shape[0]), 256), features.shape[1])
        if store is not None:
            grown[:start] = store[:start]
        store = grown
    store[start:end] = features
    return store, end


class NgramDrafter:
    """Model-free prompt lookup: find the latest earlier occurrence of the
    context's last n tokens (n from max_ngram down to min_ngram) and propose
    the tokens that followed it; where those run into the end of the context
    (a repeat: "7 7 7", "a b a b"), the repeat continues. Its q is a point
    mass on each proposal, so the rule accepts x with probability p(x) and
    stays exact.

    length="match" proposes the whole match, up to k tokens (as HF's
    prompt_lookup_num_tokens does). length="cost_aware" proposes only the part
    that pays for its verification, once `verify_cost` is set (v(n): the
    target's time to score n positions over its time for one, n = 1..k+1, as
    run.measure_costs gives it): the j <= k maximising expected committed
    tokens over verify cost, (1 + a + ... + a^j) / v(j + 1), where a is the
    acceptance rate this sequence has had so far from matches of the same
    n-gram length (prior 1/2). j = 0 is a plain target step. A proposal
    depends only on what came before its cycle, so the rule stays exact.
    """

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, length: str = "match"):
        if length not in LOOKUP_LENGTHS:
            raise ValueError(f"length={length} must be {' or '.join(LOOKUP_LENGTHS)} (prompt lookup's proposal length)")
        self.vocab_size, self.max_ngram, self.min_ngram, self.length = vocab_size, max_ngram, min_ngram, length
        self.verify_cost: list[float] | None = None  # [>= 2] v(1..); cost_aware proposes whole matches until it is set
        self.start(torch.empty(0))  # the per-sequence acceptance counts

    def start(self, prompt_ids: torch.Tensor) -> None:
        self._accepted = [1.0] * (self.max_ngram + 1)  # per n-gram length: pseudo-counts of a 1/2 prior
        self._tested = [2.0] * (self.max_ngram + 1)
        self._pending: tuple[int, int, int] | None = None  # (n, committed length, proposed) of the last proposal

    def propose(self, ids, k, sampling, generator):
        n, tokens = self._lookup(ids, k)
        if self.length == "cost_aware" and self.verify_cost is not None and tokens.shape[0]:
            tokens = tokens[: self._worth_proposing(n, tokens.shape[0])]
            self._pending = (n, ids.shape[0], tokens.shape[0]) if tokens.shape[0] else None
        if tokens.shape[0] == 0 or sampling.greedy:
            return tokens, None
        q = torch.zeros(tokens.shape[0], self.vocab_size, device=ids.device)
        q[torch.arange(tokens.shape[0]), tokens] = 1.0
        return tokens, q

    def _worth_proposing(self, n: int, longest: int) -> int:
        """The proposal length j <= longest with the most expected tokens per unit of verify cost."""
        a = self._accepted[n] / self._tested[n]
        longest = min(longest, len(self.verify_cost) - 1)
        per_cost = [sum(a**i for i in range(j + 1)) / self.verify_cost[j] for j in range(longest + 1)]
        return max(range(longest + 1), key=per_cost.__getitem__)  # the shortest among equals

    def _lookup(self, ids: torch.Tensor, k: int) -> tuple[int, torch.Tensor]:
        """(n, the up to k tokens after the latest earlier match of the last n tokens); n = 0: none."""
        if k == 0:
            return 0, ids.new_empty(0)
        for n in range(min(self.max_ngram, ids.shape[0] - 1), self.min_ngram - 1, -1):
            windows = ids.unfold(0, n, 1)[:-1]  # [len - n, n] every earlier n-gram
            hits = (windows == ids[-n:]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n  # the latest match: most recent context
                # A match that runs into the end is a repeat with period len - start: continue it
                # (a greedy loop such as "7 7 7" or "a b a b" then gets k tokens, not one period).
                period = ids.shape[0] - start  # >= 1
                return n, ids[start + torch.arange(k, device=ids.device) % period]  # [k]
        return 0, ids.new_empty(0)

    def rollback(self, length: int) -> None:
        if self._pending is not None:  # the last proposal's outcome: length - committed of it were accepted
            n, committed, proposed = self._pending
            accepted = length - committed
            self._accepted[n] += accepted
            self._tested[n] += min(accepted + 1, proposed)
            self._pending = None
