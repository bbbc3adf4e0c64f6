"""The exact law the check tests against, the draws it tests, and the cells that compare them.

`draw_continuations` runs the real loop N times with seeded generators (`Draw`), keeping the
prompt in the caches between runs (`PromptKept`); `TargetLaw` gives the target's exact
probability of any continuation by teacher forcing; `Partition` cuts continuation space into
cells from that law alone, each expecting at least `min_expected` of the N draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from harness.core.loop import speculative_decode, speculative_decode_rows
from harness.core.rule import verify_rows
from harness.core.sampling import Sampling, shape_probs
from harness.models.cached import CachedLM

MIN_EXPECTED = 20.0  # smallest expected count of a cell: the chi-square approximation holds above it


class Draw(NamedTuple):
    """One speculative continuation."""

    tokens: tuple[int, ...]  # the committed tokens, L of them unless an EOS came first
    bonus_prefix: tuple[int, ...] | None  # first cycle's accepted drafts, when it accepted them all
    bonus: int | None  # and the bonus token it then committed


class PromptKept:
    """A model's cache that keeps one prompt's prefix between continuations.

    Every continuation of a prompt starts from the same cache state: the
    prompt minus its last token (the loop's cache invariant). Instead of
    emptying the cache and prefilling the prompt again for each of N
    continuations, `reset()` rolls back to that prefix (the same `rollback`
    the loop uses after a rejection) and a prefill of exactly that prefix is
    skipped. The loop itself is unchanged: it feeds `ids[length:]`, now the
    prompt's last token and the drafts. The first continuation runs from an
    empty cache, as in a run, and so does every one whose cache cannot roll
    back that far (sliding-window layers drop what leaves their window).
    """

    def __init__(self, lm: CachedLM, prompt_ids: torch.Tensor):
        self.lm, self.keep = lm, prompt_ids.shape[0] - 1
        self.warm = False  # the cache holds the prompt's first `keep` tokens

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def reset(self, rollback: bool = True) -> None:
        if self.warm and self.lm.can_roll_back(self.keep):  # sliding-window layers: only while within the window
            self.lm.rollback(self.keep)
        else:
            self.warm = False
            self.lm.reset()

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if self.warm and self.lm.length == self.keep == input_ids.shape[0]:
            return None  # the kept prefix (callers that prefill it ignore its logits)
        out = self.lm.prefill(input_ids)
        self.warm = self.lm.length >= self.keep
        return out

    def forward(self, input_ids: torch.Tensor, num_logits: int = 1, **tree) -> torch.Tensor:
        out = self.lm.forward(input_ids, num_logits, **tree)
        self.warm = self.lm.length >= self.keep
        return out


@contextmanager
def prompt_kept(target, drafter, prompt_ids: torch.Tensor):
    """(target, drafter) whose CachedLM caches keep the prompt between continuations.

    Only plain CachedLMs are wrapped: a test's deliberately broken target
    wrapper (one that does not roll back, say) keeps its own reset. A target
    read by a feature head (`reads_target`) reads the whole prompt every time:
    the head needs its features from position 0.
    """
    lm = getattr(drafter, "lm", None)
    if isinstance(lm, CachedLM):
        drafter.lm = PromptKept(lm, prompt_ids)
    keeps = isinstance(target, CachedLM) and not getattr(drafter, "reads_target", ())
    try:
        yield (PromptKept(target, prompt_ids) if keeps else target), drafter
    finally:
        if isinstance(lm, CachedLM):
            drafter.lm = lm


def draw_continuations(
    target,
    drafter,
    prompt_ids: torch.Tensor,
    k: int,
    sampling: Sampling,
    length: int,
    eos_ids: set[int],
    samples: int,
    seed: int | Sequence[int],
    rule=verify_rows,
    progress=None,
) -> list[Draw]:
    """`samples` independent runs of the real loop, each with its own seeded generator.

    Per-sample seeds are drawn without replacement from [0, 2^32) by a numpy
    generator seeded with `seed`: torch's CPU generator (mt19937) keeps only
    32 bits of a seed, so distinct 32-bit seeds are what keeps two samples
    from replaying the same stream. The prompt is prefilled once (`PromptKept`).
    """
    seeds = np.random.default_rng(np.random.SeedSequence(seed)).choice(2**32, size=samples, replace=False)
    generator = torch.Generator(target.device)
    draws = []
    with prompt_kept(target, drafter, prompt_ids) as (target, drafter):
        for s in seeds:
            generator.manual_seed(int(s))
            cycles = list(speculative_decode(target, drafter, prompt_ids, k, sampling, length, eos_ids, generator, rule=rule))
            draws.append(as_draw(cycles))
            if progress is not None:
                progress.update(1)
    return draws


def draw_batches(
    target,
    drafter,
    prompts: Sequence[tuple[str, torch.Tensor]],
    batch_size: int,
    k: int,
    sampling: Sampling,
    length: int,
    eos_ids: set[int],
    samples: int,
    seed: int | tuple[int, ...],
    rule=verify_rows,
    progress=None,
) -> dict[str, tuple[list[Draw], list[tuple[int, int]]]]:
    """`samples` continuations of every prompt from the loop (harness.core.loop) over batches of rows: batches of `batch_size` rows, row j running prompt j mod P (P prompts), each row
    with its own generator (seeds as draw_continuations draws them, per prompt). Per prompt: its draws,
    and the pairs (i, j) of its draws that ran as two rows of one batch (for the rows' independence test)."""
    names = [name for name, _ in prompts]
    rows_of = [[j for j in range(batch_size) if j % len(prompts) == i] for i in range(len(prompts))]
    runs = -(-samples // min(len(r) for r in rows_of))
    seeds = [
        iter(
            np.random.default_rng(np.random.SeedSequence((*np.atleast_1d(seed).tolist(), i))).choice(
                2**32, size=runs * len(r), replace=False
            )
        )
        for i, r in enumerate(rows_of)
    ]
    out: dict[str, tuple[list[Draw], list[tuple[int, int]]]] = {name: ([], []) for name in names}
    row_prompts = [prompts[j % len(prompts)][1] for j in range(batch_size)]
    for _ in range(runs):
        generators = [torch.Generator(target.device).manual_seed(int(next(seeds[j % len(prompts)]))) for j in range(batch_size)]
        cycles: list[list] = [[] for _ in range(batch_size)]
        for step in speculative_decode_rows(target, drafter, row_prompts, k, sampling, length, eos_ids, generators, rule=rule):
            for row, c in step:
                cycles[row].append(c)
        for i, name in enumerate(names):
            draws, pairs = out[name]
            first_index = len(draws)
            draws.extend(as_draw(cycles[j]) for j in rows_of[i])
            pairs.extend((a, a + 1) for a in range(first_index, len(draws) - 1, 2))
        if progress is not None:
            progress.update(batch_size)
    return {name: (draws[:samples], [(a, b) for a, b in pairs if b < samples]) for name, (draws, pairs) in out.items()}


def as_draw(cycles: Sequence) -> Draw:
    """A Draw from one continuation's cycles. The bonus is observed when every draft of the first
    cycle was accepted and no EOS among them cut it off."""
    first = cycles[0]
    has_bonus = 0 < first.num_drafted == first.num_accepted and len(first.tokens) == first.num_drafted + 1
    return Draw(
        tuple(t for c in cycles for t in c.tokens),
        tuple(first.tokens[:-1]) if has_bonus else None,
        first.tokens[-1] if has_bonus else None,
    )


# ---------------------------------------------------------------- the exact law


class TargetLaw:
    """The target's exact law of continuations of one prompt, by teacher forcing.

    A continuation is complete when it has `length` tokens or ends at its
    first EOS; its probability is the product of the target's shaped rows
    (the same `shape_probs` the loop applies) along it. Rows are memoised by
    prefix, so a tree of prefixes costs one forward per node.

    The law drives the target's cache itself: prefill the prompt once, feed a
    path, roll back. Whoever else uses the model in between must call
    `release()` so the prompt is prefilled again.
    """

    def __init__(self, target, prompt_ids: torch.Tensor, sampling: Sampling, eos_ids: set[int], length: int):
        self.target, self.prompt_ids, self.sampling = target, prompt_ids, sampling
        self.eos_ids, self.length = set(eos_ids), length
        self._rows: dict[tuple[int, ...], np.ndarray] = {}  # prefix -> [V] float64
        self._base: int | None = None  # cached prompt length while we own the cache

    def release(self) -> None:
        """Someone else is about to use the target's cache."""
        self._base = None

    def complete(self, seq: tuple[int, ...]) -> bool:
        return len(seq) == self.length or (len(seq) > 0 and seq[-1] in self.eos_ids)

    def terminal(self, prefix: tuple[int, ...]) -> bool:
        """No continuation grows past this prefix."""
        return len(prefix) >= self.length or (len(prefix) > 0 and prefix[-1] in self.eos_ids)

    def row(self, prefix: tuple[int, ...]) -> np.ndarray:
        """[V] the target's shaped distribution of the token after prompt + prefix."""
        if prefix not in self._rows:
            self._force(prefix)
        return self._rows[prefix]

    def possible(self, seq: tuple[int, ...]) -> bool:
        """Could the target's continuation be exactly seq? Judged factor by factor: the product of
        a long continuation's probabilities underflows to 0 in float64 (below about e^-745)."""
        if not self.complete(seq) or any(t in self.eos_ids for t in seq[:-1]):
            return False
        if seq[:-1] not in self._rows:
            self._force(seq[:-1])
        return all(self._rows[seq[:i]][t] > 0.0 for i, t in enumerate(seq))

    def _force(self, path: tuple[int, ...]) -> None:
        """Teacher-force prompt + path: memoise the row after each prefix of path."""
        target = self.target
        if self._base is None:
            target.reset()
            target.prefill(self.prompt_ids[:-1])
            self._base = target.length
        feed = torch.cat([self.prompt_ids[-1:], torch.tensor(path, dtype=torch.long, device=self.prompt_ids.device)])
        logits = target.forward(feed, num_logits=feed.shape[0])  # [len(path) + 1, V]
        target.rollback(self._base)
        probs = shape_probs(logits, self.sampling).double().cpu().numpy()  # [len(path) + 1, V]
        probs /= probs.sum(-1, keepdims=True)  # float32 rows sum to 1 only to ~1e-7
        for i in range(len(path) + 1):
            self._rows.setdefault(path[:i], probs[i])


# ---------------------------------------------------------------- cells


@dataclass
class Partition:
    """Cells of continuation space, built from the exact law alone.

    Walk the prefix tree from `root`: at each node, a child token whose
    expected count n * P(prefix + token) reaches `min_expected` is expanded
    (a terminal child, at `depth` tokens past the root or an EOS, is a cell
    of its own); the node's remaining mass is one "prefix + other" cell if
    it reaches `min_expected`, else it joins the shared pooled cell. A pooled
    cell still short of `min_expected` is merged into the smallest cell, so
    every expected count is at least `min_expected` (or there is one cell).
    """

    probs: np.ndarray  # [C] target probability of each cell
    labels: list[tuple[tuple[int, ...], str]]  # (prefix, "seq" | "other" | "pool") of each cell
    depth: int
    root: tuple[int, ...] = ()
    _split: dict = field(default_factory=dict)  # prefix -> expanded child tokens
    _rest: dict = field(default_factory=dict)  # prefix -> cell of its remainder
    _leaf: dict = field(default_factory=dict)  # terminal prefix -> its cell

    @classmethod
    def build(
        cls, law: TargetLaw, n: int, depth: int, root: tuple[int, ...] = (), min_expected: float = MIN_EXPECTED
    ) -> Partition:
        part = cls(np.zeros(0), [], depth, root)
        probs: list[float] = []
        pool = -1  # index of the shared pooled cell, -1 until created
        pool_mass = 0.0

        def new_cell(mass: float, prefix: tuple[int, ...], kind: str) -> int:
            probs.append(mass)
            part.labels.append((prefix, kind))
            return len(probs) - 1

        # Depth first, most likely child first, each node's remainder after its children. An explicit
        # stack, not recursion: a near-deterministic law expands one node per token, past Python's limit.
        stack: list[tuple[tuple[int, ...], float, bool]] = [(root, 1.0, False)]  # (prefix, mass, is its remainder)
        while stack:
            prefix, mass, is_rest = stack.pop()
            if is_rest:  # the node's children are done: its remainder gets its cell now
                rest_mass = mass
                if n * rest_mass >= min_expected:
                    part._rest[prefix] = new_cell(rest_mass, prefix, "other")
                else:
                    if pool < 0:
                        pool = new_cell(0.0, (), "pool")
                    probs[pool] += rest_mass
                    pool_mass += rest_mass
                    part._rest[prefix] = pool
                continue
            if len(prefix) - len(root) >= depth or law.terminal(prefix):
                part._leaf[prefix] = new_cell(mass, prefix, "seq")
                continue
            row = law.row(prefix)  # [V]
            big = np.flatnonzero(n * mass * row >= min_expected)
            big = big[np.argsort(-row[big], kind="stable")]  # most likely first: a deterministic order
            part._split[prefix] = set(big.tolist())
            rest = np.ones_like(row, dtype=bool)
            rest[big] = False
            stack.append((prefix, mass * float(row[rest].sum()), True))  # summed directly: exact even when tiny
            stack.extend((prefix + (t,), mass * float(row[t]), False) for t in reversed(big.tolist()))

        part.probs = np.array(probs)
        if pool >= 0 and len(probs) > 1 and n * pool_mass < min_expected:
            others = [c for c in range(len(probs)) if c != pool]
            into = min(others, key=lambda c: probs[c])
            part._merge(pool, into)
        return part

    def _merge(self, cell: int, into: int) -> None:
        """Fold `cell` into `into`; the cells after `cell` move down by one."""

        def moved(c):
            return c - (c > cell)

        def renumber(c):
            return moved(into) if c == cell else moved(c)

        self.probs[into] += self.probs[cell]
        self.probs = np.delete(self.probs, cell)
        prefix, _ = self.labels[into]
        del self.labels[cell]
        self.labels[moved(into)] = (prefix, "pool")
        for table in (self._rest, self._leaf):
            for key, c in table.items():
                table[key] = renumber(c)

    def cell(self, seq: tuple[int, ...]) -> int:
        """The cell holding continuation seq (which starts with `root`)."""
        prefix = self.root
        while prefix not in self._leaf:
            nxt = seq[len(prefix)] if len(seq) > len(prefix) else None
            if nxt is None or nxt not in self._split[prefix]:
                return self._rest[prefix]
            prefix = prefix + (nxt,)
        return self._leaf[prefix]

    def counts(self, seqs: Sequence[tuple[int, ...]]) -> np.ndarray:
        """[C] observed count of each cell."""
        return np.bincount([self.cell(s) for s in seqs], minlength=len(self.probs)).astype(float)


def min_expected_for(n: int, max_cells: int) -> float:
    """Expected count per cell: at least MIN_EXPECTED, and large enough that
    there are at most about `max_cells` cells (see the module docstring)."""
    return max(MIN_EXPECTED, n / max_cells)
