"""Timing of decoding: device-synchronised wall time of forwards, rollbacks and loop functions."""

from __future__ import annotations

import time
from collections import defaultdict

from harness.models.cached import CachedLM
from harness.runner.costs import sync as _sync


class Tally:
    """Device-synchronised wall time of forward passes, counted by the number of positions fed."""

    rollback_s = 0.0

    def __init__(self, device):
        self.device = device
        self.by_positions: dict[int, list] = {}  # positions fed -> [seconds, forwards]

    @property
    def forward_s(self) -> float:
        return sum(seconds for seconds, _ in self.by_positions.values())

    @property
    def forwards(self) -> int:
        return sum(count for _, count in self.by_positions.values())

    def timed(self, positions: int, fn, *args):
        _sync(self.device)
        start = time.perf_counter()
        out = fn(*args)
        _sync(self.device)
        tally = self.by_positions.setdefault(positions, [0.0, 0])
        tally[0] += time.perf_counter() - start
        tally[1] += 1
        return out


class TimedLM(Tally):
    """A copy of a CachedLM (CachedLM.copy: the same model, a cache of its own; a static cache
    stays shared, the compiled steps being bound to it) whose forwards, prefills and feature
    captures included, and rollbacks accumulate their device-synchronised wall time. Everything
    else is the copy's."""

    def __init__(self, lm: CachedLM):
        self.lm = lm.copy(share_static_cache=True)
        super().__init__(self.lm.device)

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def forward(self, input_ids, num_logits=1):
        return self.timed(input_ids.shape[0], self.lm.forward, input_ids, num_logits)

    def forward_features(self, input_ids, num_logits, layers):
        return self.timed(input_ids.shape[0], self.lm.forward_features, input_ids, num_logits, layers)

    prefill = CachedLM.prefill  # CachedLM's verb, through this wrapper's timed forward

    def rollback(self, length):
        start = time.perf_counter()
        self.lm.rollback(length)
        _sync(self.device)
        self.rollback_s += time.perf_counter() - start


class TimedHead(Tally):
    """A feature head's storage for one row (harness.models.eagle.HeadRows: the same weights, a KV
    storage of its own), `store`, whose steps accumulate their device-synchronised wall time as
    TimedLM's forwards do, counted by the pairs fed. Its rollback only moves a length: nothing to time."""

    def __init__(self, head):
        from harness.models.eagle import HeadRows

        super().__init__(next(head.parameters()).device)
        self.store = HeadRows(head, 1)
        step = self.store.step
        self.store.step = lambda tokens, hidden, counts, from_target: self.timed(
            tokens.shape[1], step, tokens, hidden, counts, from_target
        )


class Stopwatch:
    """Wraps functions of the loop module so their time is accounted for."""

    def __init__(self, device):
        self.device, self.seconds = device, defaultdict(float)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(self.device)
            self.seconds[name] += time.perf_counter() - start
            return out

        return timed


def timed_call(fn, device) -> tuple[list[int], float]:
    """fn()'s result and its device-synchronised wall time in seconds."""
    _sync(device)
    start = time.perf_counter()
    tokens = fn()
    _sync(device)
    return tokens, time.perf_counter() - start


def timed_drafter(drafter):
    """(its timed draft: TimedHead or TimedLM, a drafter of the same kind drafting through it) for a head or a model draft."""
    from harness.core.drafters import FeatureDrafter, ModelDrafter

    if drafter.reads_target:
        draft = TimedHead(drafter.head)
        return draft, FeatureDrafter(drafter.head, draft.store)
    draft = TimedLM(drafter.lm)
    return draft, ModelDrafter(draft)
