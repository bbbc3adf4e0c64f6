"""Is the acceptance a run reports the draft's own? A teacher-forced check at temperature 0.

The exactness check (harness.exactness.main) and greedy output comparisons
cannot see a drafter whose context silently differs from the committed
tokens: a rejected draft left in its KV cache in place of the recovered
token, or every position shifted by one. The target verifies every draft,
so the output law stays exact and the greedy output identical; only the
reported acceptance is wrong, and that is the number drafts are chosen by.

The argument. At temperature 0 the committed tokens are the target's greedy
tokens, and the loop's draft for position j of a cycle (j = 0 first) is
the drafter's greedy proposal after the committed prefix up to the cycle
plus its own drafts 0..j-1. Position j is tested only if drafts 0..j-1 were
accepted, so they equal the committed tokens there, and a correct drafter's
draft at any tested position is its proposal after exactly the committed
prefix up to that position. That proposal is computed here from a fresh
state, independently of the loop, and must agree with what the loop
reported at every tested position: accepted (the draft was the committed
token) for j < num_accepted, rejected at j = num_accepted when the cycle
tested one more.

  model drafter (ModelDrafter over any CachedLM, a shared-weights draft
  included): ONE forward of the draft model, through a copy of its CachedLM
  with an empty cache, over prompt + committed tokens; its argmax at each
  position is the teacher-forced proposal. The loop's draft ran one token at
  a time and this pass runs all at once, so float sums differ in order: a
  disagreement where the draft's two candidates are within its dtype's
  rounding (harness.core.ties.TIE_LOGIT_GAP) is a tie, counted apart, not a
  failure.

  prompt lookup (NgramDrafter): a proposal is one match found at the cycle
  start, so the replay is per cycle: a fresh NgramDrafter with the same
  settings proposes after the committed prefix at each cycle start, with the
  k the loop allowed it, and its proposal's agreement with the committed
  tokens must be what the loop reported, its length the number the loop
  drafted. Under a stopping draft-length policy (draft_length=cost), whose
  choice depends on the run's past, the replay proposes the length the loop
  drafted and only its tokens are compared.

  feature head (FeatureDrafter): ONE forward of the target, through a copy
  of its CachedLM, over prompt + committed tokens gives the features of every
  committed position. For each cycle starting after L committed tokens, a
  fresh copy of the head reads pairs 0..L-2 at once from those features and
  proposes; its later proposals read its own outputs and the committed
  tokens, as the loop's did when they were accepted. Ties as for models.

Command-line reachability is up to the tools: a finished run of one prompt
(its cycles) is all this needs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from harness.core.drafters import FeatureDrafter, ModelDrafter, NgramDrafter
from harness.core.lengths import DraftLength
from harness.core.loop import Cycle, Rows
from harness.core.sampling import Sampling
from harness.core.ties import TIE_LOGIT_GAP
from harness.models.eagle import HeadRows
from harness.models.shared_draft import SubsetHead

GREEDY = Sampling(0.0)


class Tested(NamedTuple):
    """One position the loop tested."""

    cycle: int  # index of the cycle
    offset: int  # drafted position within the cycle, 0..num_drafted-1
    token: int  # the committed token there
    reported: bool  # the loop accepted its draft here
    agrees: bool  # the teacher-forced proposal is the committed token
    tie: bool = False  # they differ, but the draft's choice was within its dtype's rounding
    gap: float | None = None  # the draft's logit gap behind that (model drafters only)
    proposal: int | None = None  # the teacher-forced proposal


@dataclass
class Agreement:
    """The loop's reported acceptance beside the draft's own, teacher-forced."""

    kind: str  # which check ran
    positions: list[Tested] = field(default_factory=list)  # every position the loop tested
    reported: tuple[int, int] = (0, 0)  # (accepted, tested) as the loop yielded them
    teacher_forced: tuple[int, int] = (0, 0)  # (accepted, tested) from the fresh drafter
    drafted: list[tuple[int, int, int]] = field(default_factory=list)  # (cycle, loop drafted, fresh drafted) where they differ

    @property
    def mismatches(self) -> list[Tested]:
        return [p for p in self.positions if p.reported != p.agrees and not p.tie]

    @property
    def ties(self) -> list[Tested]:
        return [p for p in self.positions if p.reported != p.agrees and p.tie]

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.drafted

    def describe(self) -> str:
        """One line: the verdict, the counts and, on failure, the first disagreement."""
        counts = (
            f"the loop reported {self.reported[0]} accepted of {self.reported[1]} tested, the teacher-forced "
            f"draft {self.teacher_forced[0]} of {self.teacher_forced[1]} ({len(self.ties)} ties)"
        )
        if self.ok:
            return f"acceptance is the draft's own ({self.kind}): {counts}"
        if self.drafted:
            cycle, loop, fresh = self.drafted[0]
            first = f"cycle {cycle} drafted {loop} tokens where a fresh drafter proposes {fresh}"
        else:
            p = self.mismatches[0]
            verdict = "accepted" if p.reported else "rejected"
            gap = f" (a margin of {p.gap:.3g} logits)" if p.gap is not None else ""
            first = (
                f"cycle {p.cycle}, drafted position {p.offset}: the loop {verdict} a draft of committed token {p.token}, "
                f"but the draft's teacher-forced proposal there is {p.proposal}{gap}"
            )
        return (
            f"reported acceptance is not the draft's own ({self.kind}): {counts}; {len(self.mismatches)} positions "
            f"and {len(self.drafted)} cycles disagree, first {first}"
        )


def teacher_forced_agreement(
    drafter,
    prompt_ids: torch.Tensor,
    cycles: Sequence[Cycle],
    k: int,
    max_new_tokens: int,
    tie_gap: float | None = None,
    target=None,
) -> Agreement:
    """Check a finished temperature-0 run of one prompt (the loop's `cycles` after `prompt_ids` [T],
    run with `k` and `max_new_tokens`) against the drafter's own proposals from a fresh state.
    `drafter` is the one the run used: only its kind, model and settings are read; a feature head
    also needs the run's `target` (CachedLM). `tie_gap`: draft logit gaps at or below it are ties
    (default: TIE_LOGIT_GAP for the draft's dtype)."""
    kind = getattr(drafter, "kind", None)
    if kind == "model":
        return _model_check(drafter, prompt_ids, cycles, k, max_new_tokens, tie_gap)
    if kind == "prompt lookup":
        return _lookup_check(drafter, prompt_ids, cycles, k, max_new_tokens)
    if kind == "feature head":
        if target is None:
            raise TypeError("a feature head's teacher-forced check needs the run's target")
        return _feature_check(drafter, target, prompt_ids, cycles, k, max_new_tokens, tie_gap)
    raise TypeError(f"no teacher-forced acceptance check for a {type(drafter).__name__}")


def _cycle_spans(cycles: Sequence[Cycle], k: int, max_new_tokens: int):
    """Per cycle: (index, cycle, committed tokens before it, the most it could draft)."""
    start = 0
    for i, c in enumerate(cycles):
        yield i, c, start, min(k, max_new_tokens - start - 1)
        start += len(c.tokens)


def _agreeing_prefix(proposal: list[int], committed: list[int]) -> tuple[int, int]:
    """(accepted, tested) of a proposal against the tokens its cycle committed, as greedy verify counts them."""
    length = min(len(proposal), len(committed))  # an EOS among the accepted drafts ends the cycle
    accepted = next((j for j in range(length) if proposal[j] != committed[j]), length)
    return accepted, min(accepted + 1, length)


def _model_check(drafter: ModelDrafter, prompt_ids, cycles, k, max_new_tokens, tie_gap) -> Agreement:
    head = drafter.lm.model.get_output_embeddings()
    agreement = Agreement(f"model{' (shared weights)' if isinstance(head, SubsetHead) else ''}: one teacher-forced draft pass")
    committed = [t for c in cycles for t in c.tokens]
    if not committed:
        return agreement
    lm = copy.copy(drafter.lm)  # the same model and forward, an empty cache of its own
    lm.reset()
    ids = torch.cat([prompt_ids.to(lm.device), torch.tensor(committed[:-1], device=lm.device)])  # [T + n - 1]
    rows = lm.forward(ids, num_logits=len(committed)).float()  # [n, V]: row i scores committed token i
    lm.reset()
    dtype = next(drafter.lm.model.parameters()).dtype
    tolerance = TIE_LOGIT_GAP.get(dtype, 1e-3) if tie_gap is None else tie_gap
    for i, c, start, most in _cycle_spans(cycles, k, max_new_tokens):
        if c.num_drafted != most:  # a ModelDrafter drafts all it is allowed
            agreement.drafted.append((i, c.num_drafted, most))
        _compare(agreement, i, c, rows[start : start + c.num_drafted], tolerance)
    return _totals(agreement, cycles)


def _compare(agreement: Agreement, i: int, c: Cycle, rows: torch.Tensor, tolerance: float) -> None:
    """Cycle i's tested positions against the teacher-forced draft's rows [drafted, V] (row j: its proposal at j)."""
    proposals = rows.argmax(-1).tolist()
    a, t = _agreeing_prefix(proposals, c.tokens)
    agreement.teacher_forced = (agreement.teacher_forced[0] + a, agreement.teacher_forced[1] + t)
    for j in range(len(c.expected_acceptance)):
        token = c.tokens[j]
        reported, agrees = j < c.num_accepted, proposals[j] == token
        gap = None
        if reported != agrees:
            row = rows[j]  # [V]
            if reported:  # the loop drafted `token`: how far the draft's best is above it
                gap = float(row.max() - row[token])
            else:  # the loop drafted something else, unknown: how far the best is above the runner-up
                top2 = row.topk(2).values
                gap = float(top2[0] - top2[1])
        tie = gap is not None and gap <= tolerance
        agreement.positions.append(Tested(i, j, token, reported, agrees, tie, gap, proposals[j]))


def _totals(agreement: Agreement, cycles) -> Agreement:
    agreement.reported = (sum(c.num_accepted for c in cycles), sum(len(c.expected_acceptance) for c in cycles))
    return agreement


def _feature_check(drafter: FeatureDrafter, target, prompt_ids, cycles, k, max_new_tokens, tie_gap) -> Agreement:
    agreement = Agreement("feature head: the target's features from one pass, a fresh head per cycle")
    committed = [t for c in cycles for t in c.tokens]
    if not committed:
        return agreement
    lm = target.copy()  # the same model and forward, an empty cache of its own
    lm.reset()
    ids = torch.cat([prompt_ids.to(lm.device), torch.tensor(committed, device=lm.device)])  # [N]
    _, features = lm.forward_features(ids[:-1], 1, drafter.reads_target)  # [N - 1, F]: position i's, i = 0..N-2
    lm.reset()
    dtype = next(drafter.head.parameters()).dtype
    tolerance = TIE_LOGIT_GAP.get(dtype, 1e-3) if tie_gap is None else tie_gap
    P = prompt_ids.shape[0]
    for i, c, start, most in _cycle_spans(cycles, k, max_new_tokens):
        L = P + start  # committed before the cycle
        expected = most if i > 0 and L >= 2 else 0  # the first cycle drafts nothing: the target has not read the prompt
        if c.num_drafted != expected:
            agreement.drafted.append((i, c.num_drafted, expected))
        if c.num_drafted == 0 or expected == 0:
            continue
        head = HeadRows(drafter.head, 1)  # the head with an empty cache of its own
        logits, out = head.step(ids[None, 1:L], features[None, : L - 1], [L - 1], from_target=True)  # pairs 0..L-2
        rows = [logits[0]]
        for j in range(1, c.num_drafted):  # its own output and the committed token (= its draft where tested)
            logits, out = head.step(ids[None, L + j - 1 : L + j], out[:, -1:], [1], from_target=False)
            rows.append(logits[0])
        _compare(agreement, i, c, torch.stack(rows).float(), tolerance)
    return _totals(agreement, cycles)


def _lookup_check(drafter: NgramDrafter, prompt_ids, cycles, k, max_new_tokens) -> Agreement:
    fresh = copy.copy(drafter)  # the same settings, a state of its own (start)
    fresh.draft_length, stopping = DraftLength(), drafter.draft_length.stops  # a stopping policy's lengths: the loop's
    agreement = Agreement(
        f"prompt lookup (draft_length={drafter.draft_length.name}): a fresh lookup replayed on each committed prefix"
    )
    fresh.start([prompt_ids])
    ids = prompt_ids  # [L] committed so far
    accepted = tested = 0
    for i, c, _, most in _cycle_spans(cycles, k, max_new_tokens):
        drafted = fresh.propose(Rows([ids], [None]), [c.num_drafted if stopping else most], GREEDY)
        proposal = drafted.tokens[0, : drafted.counts[0]].tolist()  # [k'']
        if len(proposal) != c.num_drafted:
            agreement.drafted.append((i, c.num_drafted, len(proposal)))
        a, t = _agreeing_prefix(proposal, c.tokens)
        accepted, tested = accepted + a, tested + t
        for j in range(len(c.expected_acceptance)):
            fresh_token = proposal[j] if j < len(proposal) else None
            agrees = fresh_token == c.tokens[j]
            agreement.positions.append(Tested(i, j, c.tokens[j], j < c.num_accepted, agrees, proposal=fresh_token))
        fresh.rollback([ids.shape[0] + a])
        ids = torch.cat([ids, ids.new_tensor(c.tokens)])
    agreement.reported = (sum(c.num_accepted for c in cycles), sum(len(c.expected_acceptance) for c in cycles))
    agreement.teacher_forced = (accepted, tested)
    return agreement
