"""Draft length as a policy: how many tokens each row drafts in a cycle, k being the cap.

The loop asks a policy for each row's budget before the cycle (`budgets`), a drafter asks it between
drafted positions whether a row goes on (`go_on`, only for a policy that `stops`: from the probability
the draft gave its own token, one host read of those per drafted position), and the loop tells it each
row's outcome after the verdict (`outcome`). Every decision is made from the draft's own outputs and
the run's past cycles, never from the target's row being verified, so each committed token keeps the
target's law (docs/metrics.md, "Draft length").

  constant    k every cycle (the default).
  heuristic   HF's schedule: +2 after a cycle whose drafts were all accepted, -1 otherwise, within 1..k.
  confidence  stop at the first drafted token the draft gives probability below `threshold` (a number,
              or auto: refitted from the run's accepted/rejected tokens each time they grow by 1/16, ROC as HF does).
  cost        draft on while a longer draft has expected tokens per unit of cost at least the cycle's so far:
              E[tokens] counts P(a draft and every earlier one accepted), from the draft's probabilities
              calibrated online against the run's outcomes; cost is n c + v(n + 1), c and v(n) measured on
              this machine. 0 drafts (a plain target step) when no draft pays.
  by_batch    k per batch size from a table (vLLM's num_speculative_tokens per batch size), 0 allowed.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from harness.config.settings import DRAFT_LENGTHS

POLICIES = DRAFT_LENGTHS
BINS = 10  # calibration bins of the draft's probability, equal widths over [0, 1]
START_THRESHOLD = 0.4  # confidence=auto before any outcome (HF's default)
EXPLORE = 8  # cost: a row that drafted nothing for this many cycles drafts one token, so the run keeps measuring the draft


class Calibration:
    """The draft's probability of its own token against whether the target accepted it, in BINS bins: each
    bin's acceptance estimated with one pseudo-observation at the bin's middle (a calibrated draft's)."""

    def __init__(self):
        self.tested, self.accepted, self.probability = np.zeros(BINS), np.zeros(BINS), np.zeros(BINS)
        self.pairs: list[tuple[float, bool]] = []  # (probability, accepted) of every tested drafted token, in order

    @staticmethod
    def bin(p: float) -> int:
        return min(int(p * BINS), BINS - 1)

    def add(self, p: float, accepted: bool) -> None:
        b = self.bin(p)
        self.tested[b] += 1
        self.accepted[b] += accepted
        self.probability[b] += p
        self.pairs.append((p, accepted))

    def __call__(self, p: float) -> float:
        """P(accepted | the draft gave its token probability p)."""
        b = self.bin(p)
        return (self.accepted[b] + (b + 0.5) / BINS) / (self.tested[b] + 1)

    def mean(self) -> float:
        """The acceptance rate of every tested position so far (1/2 before any)."""
        return (self.accepted.sum() + 0.5) / (self.tested.sum() + 1)

    def table(self) -> list[dict]:
        """Per bin with outcomes: the draft's mean probability (predicted) and the observed acceptance."""
        return [
            {"bin": [b / BINS, (b + 1) / BINS], "tested": int(t), "predicted": float(p / t), "observed": float(a / t)}
            for b, (t, a, p) in enumerate(zip(self.tested, self.accepted, self.probability))
            if t
        ]


class DraftLength:
    """constant: every row drafts its cap. The base of the others."""

    name = "constant"
    stops = False  # consulted between drafted positions (go_on): the drafter reads its tokens' probabilities

    def __init__(self):
        self.calibration = Calibration()
        self.pending: list[list[float]] = []  # per row, the probabilities of this cycle's drafts (stopping policies)

    def start(self, rows: int) -> None:
        self.pending = [[] for _ in range(rows)]

    def budgets(self, caps: list[int]) -> list[int]:
        return list(caps)

    def go_on(self, row: int, p: float) -> bool:
        self.pending[row].append(p)
        return True

    def outcome(self, drafted: list[int], accepted: list[int]) -> None:
        """Row i drafted drafted[i] tokens and the target accepted the first accepted[i]."""
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            for j, p in enumerate(self.pending[i][:d][: a + 1]):  # tested: the accepted, then the first rejected
                self.calibration.add(p, j < a)
            self.pending[i] = []

    def keep(self, rows: list[int]) -> None:
        self.pending = [self.pending[i] for i in rows]

    def use_costs(self, costs: dict) -> None: ...

    def describe(self) -> dict:
        out = {"policy": self.name}
        if self.stops:
            out["calibration"] = self.calibration.table()
        return out


class Heuristic(DraftLength):
    name = "heuristic"

    def start(self, rows: int) -> None:
        super().start(rows)
        self.lengths: list[int | None] = [None] * rows  # None: the cap, until a first outcome

    def budgets(self, caps):
        return [cap if n is None else min(cap, n) for cap, n in zip(caps, self.lengths)]

    def outcome(self, drafted, accepted):
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            if d:
                self.lengths[i] = d + 2 if a == d else max(1, d - 1)
        super().outcome(drafted, accepted)

    def keep(self, rows):
        super().keep(rows)
        self.lengths = [self.lengths[i] for i in rows]


class Confidence(DraftLength):
    name = "confidence"
    stops = True

    def __init__(self, threshold: float | str = START_THRESHOLD):
        super().__init__()
        self.auto, self.fitted_at = threshold == "auto", 0  # fitted_at: the outcomes the threshold was fitted on
        self.threshold = START_THRESHOLD if self.auto else float(threshold)

    def go_on(self, row, p):
        super().go_on(row, p)
        return p >= self.threshold

    def outcome(self, drafted, accepted):
        super().outcome(drafted, accepted)
        n = len(self.calibration.pairs)
        if self.auto and n - self.fitted_at >= max(1, n // 16):  # refitted as outcomes grow by 1/16: O(1) a cycle on average
            self.threshold, self.fitted_at = roc_threshold(self.calibration.pairs, self.threshold), n

    def describe(self):
        return {**super().describe(), "threshold": self.threshold, "threshold_fitted": self.auto}


def roc_threshold(pairs: list[tuple[float, bool]], current: float) -> float:
    """The probability threshold nearest the ROC curve's ideal corner (false positives 0, true positives 1)
    over the (probability, accepted) pairs so far; `current` until both outcomes were seen."""
    p = np.array([x for x, _ in pairs])
    ok = np.array([a for _, a in pairs], dtype=bool)
    if ok.all() or not ok.any():
        return current
    candidates, accepted, rejected = np.unique(p), np.sort(p[ok]), np.sort(p[~ok])  # refitted every cycle: sorted, not n x n
    tpr = 1 - np.searchsorted(accepted, candidates, side="left") / len(accepted)  # share of the accepted at or above
    fpr = 1 - np.searchsorted(rejected, candidates, side="left") / len(rejected)
    return float(candidates[np.argmin(fpr**2 + (1 - tpr) ** 2)])


class Cost(DraftLength):
    name = "cost"
    stops = True

    def __init__(self):
        super().__init__()
        self.c, self.v = None, None  # c and v(1..): set by use_costs; until then the cap (as constant)

    def use_costs(self, costs):
        self.c, self.v = float(costs["cost_ratio"]), list(costs["verify_cost"])

    def start(self, rows):
        super().start(rows)
        self.reach = [1.0] * rows  # per row, P(every draft so far accepted), this cycle
        self.tokens = [1.0] * rows  # per row, E[tokens] of the cycle so far (the bonus or recovered one counted)
        self.idle = [0] * rows  # per row, cycles since it last drafted

    def _pays(self, row: int, n: int) -> bool:
        """Whether to draft on, n drafted: whether some longer draft m > n (within the measured v) has expected
        tokens per cost at least the cycle's now, later positions priced at the mean acceptance (v need not be
        convex: a CPU's verify cost jumps at some widths, so the next position alone may not pay while two do)."""
        if self.v is None:
            return True
        now = self.tokens[row] / (n * self.c + self.v[n])
        expected, reach, mean = self.tokens[row], self.reach[row], self.calibration.mean()
        for m in range(n + 1, len(self.v)):
            reach *= mean  # the next draft's own probability is not known before it is drafted
            expected += reach
            if expected / (m * self.c + self.v[m]) >= now:
                return True
        return False

    def budgets(self, caps):
        """The cap where a first draft pays; else none, but one token after EXPLORE idle cycles: without
        drafts the calibration would learn nothing more, and a run that stopped drafting would never start again."""
        self.reach, self.tokens = [1.0] * len(caps), [1.0] * len(caps)
        return [cap if cap and self._pays(i, 0) else min(cap, 1) if self.idle[i] >= EXPLORE else 0 for i, cap in enumerate(caps)]

    def go_on(self, row, p):
        super().go_on(row, p)
        n = len(self.pending[row])
        self.reach[row] *= self.calibration(p)
        self.tokens[row] += self.reach[row]
        return self._pays(row, n)

    def outcome(self, drafted, accepted):
        super().outcome(drafted, accepted)
        self.reach, self.tokens = [1.0] * len(drafted), [1.0] * len(drafted)  # the next cycle starts afresh
        self.idle = [0 if d else n + 1 for d, n in zip(drafted, self.idle)]

    def keep(self, rows):
        super().keep(rows)
        self.reach, self.tokens, self.idle = ([values[i] for i in rows] for values in (self.reach, self.tokens, self.idle))

    def describe(self):
        return {**super().describe(), "cost_ratio": self.c, "verify_cost": self.v}


class ByBatch(DraftLength):
    name = "by_batch"

    def __init__(self, table: dict):
        super().__init__()
        self.table = sorted((int(b), int(k)) for b, k in table.items())

    def budgets(self, caps):
        rows = len(caps)
        k = next((k for b, k in reversed(self.table) if b <= rows), self.table[0][1])  # the largest size <= rows
        return [min(cap, k) for cap in caps]

    def describe(self):
        return {**super().describe(), "table": dict(self.table)}


class Whole(DraftLength):
    """Every row drafts its cap, reading each drafted token's probability where `reads` (as a stopping policy
    does): how a draft step is timed before a run, so that c includes what the run's policy pays a step."""

    def __init__(self, reads: bool):
        super().__init__()
        self.stops = reads


@contextmanager
def drafting_whole(drafter, rows: int):
    """`drafter` proposes whole budgets in the block (a draft step timed), its own policy left as it was."""
    policy = getattr(drafter, "draft_length", None)
    if policy is None:  # a drafter without a policy drafts its budgets
        yield
        return
    drafter.draft_length = Whole(policy.stops)
    drafter.draft_length.start(rows)
    try:
        yield
    finally:
        drafter.draft_length = policy


def make_policy(policy: str = "constant", threshold: float | str = START_THRESHOLD, table: dict | None = None) -> DraftLength:
    """The policy named `policy` (POLICIES), with its settings (conf/draft_length/)."""
    if policy == "heuristic":
        return Heuristic()
    if policy == "confidence":
        return Confidence(threshold)
    if policy == "cost":
        return Cost()
    if policy == "by_batch":
        return ByBatch(table or {1: 1})
    if policy == "constant":
        return DraftLength()
    raise ValueError(f"draft_length={policy}: use one of {', '.join(POLICIES)}")
