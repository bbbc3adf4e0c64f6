"""Timing: stamps on a decode from outside, and the cost model's figures.

`timed` stamps each item a decode generator yields, the device synchronised;
`measure_costs` measures a target step, the verify cost v(n) and the draft's
cost ratio c (docs/metrics.md) in isolated repetitions before a run, and
`Clock` times the same passes inside the run itself (the summary's in-run costs).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING

import torch

from harness.core.metrics import median_ci
from harness.core.sampling import Sampling
from harness.models.batched import rows_of

if TYPE_CHECKING:
    from harness.runner.pair import Pair


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so that a clock read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(generator, device: torch.device) -> tuple[list, list[float]]:
    """Drain a decode generator, stamping each yield (device synchronised)."""
    items, stamps = [], []
    start = time.perf_counter()
    for item in generator:
        sync(device)
        stamps.append(time.perf_counter() - start)
        items.append(item)
    return items, stamps


class Clock:
    """Seconds a decode spends in its target passes and draft proposals after its first yield
    (the prompt's pass, which the decode figures leave out), tallied by key: `verify@n` for a target
    pass over n positions, `draft` for a proposal (its forwards, sampling and lookup alike). On a CPU
    the wall clock around each call; on CUDA a pair of events, read when the prompt is done, so that
    no pass waits for the host. The tally goes in each prompt's record (`tally`)."""

    def __init__(self, device: torch.device):
        self.device, self.on = device, False
        self.spans: list[tuple[str, object, object]] = []  # (key, start, end): times or CUDA events

    def mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def timing(self, fn, key):
        """fn, its calls timed under key(*args) while the clock is on."""

        def clocked(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = self.mark()
            out = fn(*args, **kwargs)
            self.spans.append((key(*args), start, self.mark()))
            return out

        return clocked

    @contextlib.contextmanager
    def watching(self, target, drafter=None):
        """The target's passes (forward, forward_features) and the drafter's proposals timed for the
        duration; the instances' own methods afterwards."""
        positions = lambda ids, *rest: f"verify@{width(ids)}"  # noqa: E731
        patched = [(target, name, positions) for name in ("forward", "forward_features") if hasattr(target, name)]
        if drafter is not None:
            patched.append((drafter, "propose", lambda *args: "draft"))
        own = [(obj, name, vars(obj).get(name)) for obj, name, _ in patched]  # an instance's own override, if any
        for obj, name, key in patched:
            setattr(obj, name, self.timing(getattr(obj, name), key))
        try:
            yield self
        finally:
            for obj, name, before in own:
                if before is None:
                    delattr(obj, name)  # the class's method again
                else:
                    setattr(obj, name, before)

    def after_first(self, generator):
        """The generator's items; the clock runs from the second item's work on."""
        for item in generator:
            yield item
            self.on = True

    def tally(self) -> dict[str, list]:
        """{key: [seconds, calls]}."""
        out: dict[str, list] = {}
        for key, start, end in self.spans:
            spent = start.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - start
            entry = out.setdefault(key, [0.0, 0])
            entry[0] += spent
            entry[1] += 1
        return out


def measure_costs(pair: Pair, prompts: torch.Tensor | list[torch.Tensor], k: int, sampling: Sampling, rounds: int = 9) -> dict:
    """Target step time, verify cost v(n) = T(n positions) / T(1), draft cost ratio c, of passes over
    B = len(prompts) rows (one prompt [T]: B = 1), each row at its own prompt's context (a ragged step,
    as the loop runs it), in units of the B-row step: the figures a cell's prediction prices its cycles with.

    A feature head's verify passes return the features it reads, and its k drafts start with one
    pair read from the target's features, as in a cycle after a rejection at the first draft.
    Measured at the context length of real prompts, in interleaved rounds: each round times a
    target pass over 1..k+1 positions and then a k-token draft, and each figure is the median over
    rounds (v and c of the ratios within a round). Timed in separate blocks instead, a drift in the
    machine's speed between blocks lands in the ratios: one compiled run put v(3) 4% under what the
    loop then paid.
    """
    from harness.core.loop import Rows

    prompts = [prompts] if isinstance(prompts, torch.Tensor) else list(prompts)
    device, B, drafter = pair.device, len(prompts), pair.drafter
    target = rows_of(pair.target, B)
    reads = drafter.reads_target  # a feature head: the verify returns its features, as in the loop
    prompts = [ids[-max(pair.context - k, 1) :] for ids in prompts]  # room for the k + 1 positions scored after each
    lengths = [ids.shape[0] - 1 for ids in prompts]
    target.start(B)
    if reads:
        _, prompt_features = target.forward_features([ids[:-1] for ids in prompts], [0] * B, reads)
    else:
        target.forward([ids[:-1] for ids in prompts], [0] * B)
    extra = [ids[-1:].repeat(k + 1) for ids in prompts]  # positions to score; their values do not matter for timing
    generators = [torch.Generator(device).manual_seed(row) for row in range(B)]

    def score(n: int) -> float:
        """Seconds of a target pass over n positions per row; the rollback after it is not timed (a step has none)."""
        feeds = [e[:n] for e in extra]
        if reads:
            spent = seconds(device, lambda: target.forward_features(feeds, [n] * B, reads))
        else:
            spent = seconds(device, lambda: target.forward(feeds, [n] * B))
        target.rollback(lengths)
        return spent

    def draft() -> float:
        drafter.start(prompts)
        if reads:  # each row's head holds its prompt's pairs but the last, as after a cycle that rejected its first draft
            drafter.observe([(features, 0) for features in prompt_features])
            drafter.propose(Rows([ids[:-1] for ids in prompts], generators), [1] * B, sampling)
            drafter.rollback(lengths)
        score(k + 1)  # as in the loop, the draft runs right after a target pass (see `cost_rounds`)
        rows = Rows(prompts, generators)
        return seconds(device, lambda: drafter.propose(rows, [k] * B, sampling)) / k

    costs = cost_rounds(score, draft, k, rounds)
    return {**costs, "batch_size": B} if B > 1 else costs


def seconds(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def cost_rounds(score, draft, k: int, rounds: int) -> dict:
    """The cost figures from interleaved rounds: each round times `score(n)` (a target pass over n
    positions) for n = 1..k+1, then `draft()` (seconds per drafted token). On a CPU the draft runs right
    after a target pass, as in the loop: the target's weights have evicted the draft's from the caches
    (measured back to back instead, the draft step looks ~25% cheaper than it is)."""
    verify_s, draft_s = [], []  # [rounds, k + 1] scoring 1..k+1 positions; [rounds] per drafted token
    for _ in range(rounds):
        verify_s.append([score(n) for n in range(1, k + 2)])
        draft_s.append(draft())
    median = statistics.median
    step_ratios = [d / row[0] for d, row in zip(draft_s, verify_s)]
    verify_ratios = [[row[n] / row[0] for row in verify_s] for n in range(k + 1)]  # [k + 1][rounds]: v(n) per round
    costs = {
        "target_step_s": median(row[0] for row in verify_s),
        "target_step_s_ci": median_ci([row[0] for row in verify_s]),
        "draft_step_s": median(draft_s),
        "draft_step_s_ci": median_ci(draft_s),
        "cost_ratio": median(step_ratios),
        "cost_ratio_ci": median_ci(step_ratios),
        "verify_s": [median(row[n] for row in verify_s) for n in range(k + 1)],  # [k + 1]: scoring 1..k+1 positions
        "verify_cost": [median(ratios) for ratios in verify_ratios],  # [k + 1]: v(n) = T(n) / T(1)
        "verify_cost_ci": [median_ci(ratios) for ratios in verify_ratios],
        "rounds": rounds,
    }
    costs["verify_cost_dips"] = verify_cost_dips(costs["verify_cost_ci"])
    return costs


def width(ids) -> int:
    """Positions a pass feeds: a sequence's ids [T], or a batch's feeds (its padded width)."""
    return ids.shape[0] if isinstance(ids, torch.Tensor) else max(1, max(f.shape[0] for f in ids))


def verify_cost_dips(intervals: list[tuple[float, float]]) -> list[int]:
    """The n where scoring n positions cost clearly less than scoring fewer (v(n)'s interval
    wholly below an earlier v(m)'s): a verify-cost curve that is not monotone beyond its own
    intervals is a measurement problem (a plan or kernel change between row counts, another
    process on the cores), which the table flags rather than predicting from it silently."""
    dips = []
    for n in range(1, len(intervals)):
        if any(intervals[n][1] < intervals[m][0] for m in range(n)):
            dips.append(n + 1)  # intervals[i] is v(i + 1)
    return dips
