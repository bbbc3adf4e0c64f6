"""Timing: stamps on a decode from outside (`timed`), the cost model's figures measured in isolated rounds
before a run (`measure_costs`: docs/metrics.md), and the same passes timed inside the run (`Clock`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING

import torch

from harness.core.lengths import drafting_whole
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
    """Seconds a decode spends in its target passes (`verify@n`: n positions) and draft proposals (`draft`)
    after its first yield, tallied by key. On CUDA a pair of events per call, read when the prompt is done,
    so that no pass waits for the host; elsewhere the wall clock."""

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
        """The target's passes and the drafter's proposals timed for the duration; their own methods afterwards."""
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


def measure_costs(
    pair: Pair, prompts: torch.Tensor | list[torch.Tensor], k: int, sampling: Sampling, rounds: int = 9, widest: int = 0
) -> dict:
    """Target step time, verify cost v(n) = T(n positions) / T(1) and draft cost ratio c, of passes over
    B = len(prompts) rows (one prompt [T]: B = 1) at their prompts' contexts, in units of the B-row step.
    A feature head's drafts start with one pair read from the target's features (as after a rejection at
    the first draft). Interleaved rounds (`cost_rounds`), so that drift in the machine's speed cancels. widest: v(n)
    up to n = widest + 1 at least (a token tree of `widest` nodes; its drafts are timed per level, k levels)."""
    from harness.core.loop import Rows

    prompts = [prompts] if isinstance(prompts, torch.Tensor) else list(prompts)
    device, B, drafter = pair.device, len(prompts), pair.drafter
    target = rows_of(pair.target, B)
    reads = drafter.reads_target  # a feature head: the verify returns its features, as in the loop
    scored = max(k, widest)
    prompts = [ids[-max(pair.context - scored, 1) :] for ids in prompts]  # room for the positions scored after each
    lengths = [ids.shape[0] - 1 for ids in prompts]
    verify = (lambda feeds, n: target.forward_features(feeds, n, reads)) if reads else target.forward
    target.start(B)
    prompt_features = verify([ids[:-1] for ids in prompts], [0] * B)[1] if reads else None
    extra = [ids[-1:].repeat(scored + 1) for ids in prompts]  # positions to score; their values do not matter for timing
    generators = [torch.Generator(device).manual_seed(row) for row in range(B)]

    def score(n: int) -> float:
        """Seconds of a target pass over n positions per row; the rollback after it is not timed (a step has none)."""
        feeds = [e[:n] for e in extra]
        spent = seconds(device, lambda: verify(feeds, [n] * B))
        target.rollback(lengths)
        return spent

    def draft() -> float:
        drafter.start(prompts)
        if reads:  # each row's head holds its prompt's pairs but the last, as after a cycle that rejected its first draft
            drafter.observe([(features, 0) for features in prompt_features])
            drafter.propose(Rows([ids[:-1] for ids in prompts], generators), [1] * B, sampling)
            drafter.rollback(lengths)
        score(scored + 1)  # as in the loop, the draft runs right after a target pass (see `cost_rounds`)
        rows = Rows(prompts, generators)
        return seconds(device, lambda: drafter.propose(rows, [k] * B, sampling)) / k

    with drafting_whole(drafter, B):  # k drafts every round, whatever the cell's draft-length policy
        costs = cost_rounds(score, draft, scored, rounds)
    return {**costs, "batch_size": B} if B > 1 else costs


def seconds(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def cost_rounds(score, draft, k: int, rounds: int) -> dict:
    """The cost figures from interleaved rounds: each times `score(n)` (a target pass over n positions) for
    n = 1..k+1, then `draft()` (seconds per drafted token), each figure the median over rounds. `draft` runs
    right after a target pass, as in the loop (back to back, a CPU's caches make it look ~25% cheaper)."""
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
    """The n where scoring n positions cost clearly less than scoring fewer (v(n)'s interval wholly below an
    earlier v(m)'s): a measurement problem the table flags rather than predicting from it silently."""
    dips = []
    for n in range(1, len(intervals)):
        if any(intervals[n][1] < intervals[m][0] for m in range(n)):
            dips.append(n + 1)  # intervals[i] is v(i + 1)
    return dips


def step_bytes(model, positions: int, rows: int) -> int:
    """Bytes a decode step of `rows` rows reads at `positions` cached positions: every weight but the input
    embedding table (a row a token; read whole where it is also the LM head), and the keys and values."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * positions * rows * embed.element_size()
    return weights + kv


def limits(pair: Pair, costs: dict, prompts: list[torch.Tensor]) -> dict:
    """How far the target's step (and the draft's) is from reading its bytes once at the device's memory
    bandwidth (harness.base.bandwidth): limit_ratio = step time / (bytes a step reads / bandwidth), at the
    rows and contexts measure_costs timed. A feature head's bytes are its own weights (the KV of its one
    layer left out); prompt lookup reads no weights."""
    from harness.base.bandwidth import limit_ratio, measured
    from harness.base.device import device_identity

    bandwidth = measured(pair.device, device_identity(pair.device))
    rows, positions = len(prompts), round(statistics.mean(ids.shape[0] for ids in prompts))
    drafts = pair.drafter.models()
    out = {
        "bandwidth_gb_s": bandwidth["gb_per_s"],
        "bandwidth_spread": bandwidth["spread"],
        "bandwidth_source": bandwidth["source"],
        "rows": rows,
        "positions": positions,
        "target_bytes_per_step": step_bytes(pair.target.model, positions, rows),
    }
    out["target_limit_ratio"] = limit_ratio(costs["target_step_s"], out["target_bytes_per_step"], bandwidth["gb_per_s"])
    draft_bytes = step_bytes(drafts[0], positions, rows) if drafts else pair.drafter.size(pair.target.model)["draft_bytes"]
    if draft_bytes and pair.drafter.forwards:
        out["draft_bytes_per_step"] = draft_bytes
        out["draft_limit_ratio"] = limit_ratio(costs["draft_step_s"], draft_bytes, bandwidth["gb_per_s"])
    return out
