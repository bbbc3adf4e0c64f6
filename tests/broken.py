"""Deliberately broken speculative samplers: the exactness check must reject each.

Test code only: nothing here is reachable from a configuration. Each variant
plugs into the REAL `harness.core.loop.speculative_decode` through what the loop
already offers: its `rule=` argument, a drafter subclass, a target wrapper,
or a patched module attribute. They are the classic ways to get speculative
sampling subtly wrong; a few lossless changes are included as controls,
which the check must NOT reject.

Rule-level bugs are knobs on `speculative_rule`, a copy of
`harness.core.rule.verify` whose only differences from it are the hooks
(`acceptance`, `residual`, `bonus`) and that its acceptance coins go through
`coins`, so a test can enumerate them exactly. With default hooks it has
verify's law; tests/test_exactness.py checks that too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import harness.core.loop
from harness.core.drafters import ModelDrafter, NgramDrafter, Proposal
from harness.core.rule import Verdict, Verdicts
from harness.core.sampling import Sampling, sample, shape_probs
from harness.models.batched import LeanBatch


def coins(accept_probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[k] bool: position i accepted with probability accept_probs[i]."""
    u = torch.rand(accept_probs.shape, generator=generator, dtype=accept_probs.dtype, device=accept_probs.device)
    return u < accept_probs


def p_over_q(p_x, q_x):
    return (p_x / q_x).clamp(max=1.0)


def positive_part(p, q):
    return (p - q).clamp_min(0)


def last_row(target_probs, draft_tokens):
    return target_probs[draft_tokens.shape[0]]


def speculative_rule(
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor,  # [k, V] q
    target_probs: torch.Tensor,  # [k + 1, V] p; row k is the bonus row
    generator: torch.Generator,
    *,
    acceptance=p_over_q,  # (p_x [k], q_x [k]) -> [k] acceptance probabilities
    residual=positive_part,  # (p [V], q [V]) -> [V] weights of the recovered token
    bonus=last_row,  # (target_probs, draft_tokens) -> [V] bonus weights; None: no bonus
) -> Verdict:
    """harness.core.rule.verify with hooks where the classic bugs live."""
    k = draft_tokens.shape[0]
    positions = torch.arange(k, device=draft_tokens.device)
    p_x, q_x = target_probs[positions, draft_tokens], draft_probs[positions, draft_tokens]  # [k], [k]
    num_accepted = int(coins(acceptance(p_x, q_x), generator).cumprod(0).sum())
    expected = torch.minimum(target_probs[:k], draft_probs).sum(-1)
    if num_accepted < k:
        p, q = target_probs[num_accepted], draft_probs[num_accepted]
        weights = residual(p, q)
        weights = torch.where(weights.sum() > 0, weights, p)
    elif bonus is None and k > 0:
        # Commit the k drafts and nothing else: the last draft plays "next token".
        return Verdict(k - 1, draft_tokens[k - 1], expected)
    else:
        weights = (bonus or last_row)(target_probs, draft_tokens)  # k = 0: a plain target step
    return Verdict(num_accepted, sample(weights, generator), expected)


def rule_with(**hooks):
    return lambda tokens, q, p, generator: speculative_rule(tokens, q, p, generator, **hooks)


def per_row(rule):
    """The loop's rule (harness.core.rule.verify_rows' signature) from a rule for one sequence alone
    (verify's), applied to each row in turn with the row's own generator."""

    def rows_rule(draft_tokens, counts, draft_probs, target_probs, generators) -> Verdicts:
        verdicts = [
            rule(
                draft_tokens[i, :c],
                target_probs[i, :0] if draft_probs is None else draft_probs[i, :c],
                target_probs[i, : c + 1],
                g,
            )
            for i, (c, g) in enumerate(zip(counts, generators))
        ]
        expected = target_probs.new_zeros(draft_tokens.shape)
        for i, v in enumerate(verdicts):
            expected[i, : v.expected_acceptance.shape[0]] = v.expected_acceptance
        accepted = torch.tensor([int(v.num_accepted) for v in verdicts], device=draft_tokens.device)
        return Verdicts(accepted, torch.stack([v.next_token for v in verdicts]), expected)

    return rows_rule


class UnshapedQDrafter(ModelDrafter):
    """Samples from the shaped draft distribution but reports the unshaped
    softmax (temperature 1, no top-k / top-p) as q."""

    def propose(self, rows, budgets, sampling):
        (ids,), (k,), (generator,) = rows.ids, budgets, rows.generators
        tokens, probs = [], []
        feed = ids[self.lm.length :]
        for _ in range(k):
            logits = self.lm.forward(feed, num_logits=1)[0]  # [V]
            token = sample(shape_probs(logits, sampling), generator)
            probs.append(logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1))  # the bug
            tokens.append(token)
            feed = token[None]
        if not tokens:
            return Proposal(ids.new_zeros(1, 0), [0], None)
        return Proposal(torch.stack(tokens)[None], [k], torch.stack(probs)[None])


class NextRowDrafter(ModelDrafter):
    """A correct drafter that also keeps its own distribution for the token
    after its last draft, for a rule that (wrongly) samples the bonus there."""

    next_q: torch.Tensor | None = None

    def propose(self, rows, budgets, sampling):
        proposal = super().propose(rows, budgets, sampling)
        if proposal.counts[0]:
            logits = self.lm.forward(proposal.tokens[0, proposal.counts[0] - 1 :], num_logits=1)[0]
            self.lm.rollback(self.lm.length - 1)
            self.next_q = shape_probs(logits, sampling)
        return proposal


class PeekingDrafter(ModelDrafter):
    """A draft-length policy that peeks at the target's row (a trigram MarkovLM's table): the proposal stops
    before the first drafted token the target gives less probability than the draft did, one the rule might
    reject. Its length then depends on the target's row, and the committed tokens lose the target's law."""

    def __init__(self, lm, target):
        super().__init__(lm)
        self.target = target

    def propose(self, rows, budgets, sampling):
        proposal = super().propose(rows, budgets, sampling)
        (count,), context, V = proposal.counts, rows.ids[0].tolist(), self.target.vocab_size
        for j in range(count):
            before, last = context[-2] if len(context) > 1 else V, context[-1]
            p = shape_probs(self.target.table[before, last], sampling)  # the target's row: the peek
            x = int(proposal.tokens[0, j])
            if proposal.q is not None and p[x] < proposal.q[0, j, x]:
                return Proposal.cut(proposal.tokens, [j], proposal.q)
            context.append(x)
        return proposal


class NoRollback:
    """A target whose cache keeps rejected tokens: rollback only updates the
    length the loop is told, the cached entries stay (stale keys and shifted
    positions in a transformer, a stale context token in the trigram model)."""

    def __init__(self, lm):
        self.lm = lm
        self.length = lm.length

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def reset(self, rollback: bool = True) -> None:
        self.lm.reset()
        self.length = 0

    def forward(self, input_ids, num_logits=1):
        self.length += input_ids.shape[0]
        return self.lm.forward(input_ids, num_logits)

    def forward_features(self, input_ids, num_logits, layers):
        self.length += input_ids.shape[0]
        return self.lm.forward_features(input_ids, num_logits, layers)

    def prefill(self, input_ids):
        self.length += input_ids.shape[0]
        return self.lm.prefill(input_ids)

    def rollback(self, length: int) -> None:
        self.length = length


def target_unshaped(logits, sampling: Sampling):
    """The target's p with the temperature but without the top-k / top-p the draft used."""
    return shape_probs(logits, Sampling(sampling.temperature))


@dataclass(frozen=True)
class Variant:
    name: str
    lossless: bool
    bug: str  # in words, for the table
    # (target, drafter) -> (target, drafter, rule) handed to the loop; rule None means verify
    plug: Callable = lambda target, drafter: (target, drafter, None)
    patches: tuple = field(default_factory=tuple)  # (module, attribute, value) set while it runs
    truncating: bool = False  # the bug only exists when top-k / top-p truncate the rows
    shaped: bool = False  # the bug only exists when the rows are shaped (temperature != 1, top-k or top-p)


def _bonus_from_draft(target, drafter):
    d = NextRowDrafter(drafter.lm)
    return target, d, rule_with(bonus=lambda p, tokens: d.next_q)


def _off_by_one(tokens, q, p, generator):
    # x_i judged against the row after it (the classic logits[:, 1:] slip); bonus row kept last.
    return speculative_rule(tokens, q, torch.cat([p[1:], p[-1:]]), generator)


VARIANTS = [
    Variant(
        "accept_all",
        False,
        "accept every draft token",
        lambda t, d: (t, d, rule_with(acceptance=lambda p_x, q_x: torch.ones_like(p_x))),
    ),
    Variant(
        "resample_from_p",
        False,
        "recover from p instead of the residual",
        lambda t, d: (t, d, rule_with(residual=lambda p, q: p)),
    ),
    Variant(
        "ratio_q_over_p",
        False,
        "accept with min(1, q/p) instead of min(1, p/q)",
        lambda t, d: (t, d, rule_with(acceptance=lambda p_x, q_x: (q_x / p_x).nan_to_num(posinf=1.0).clamp(max=1.0))),
    ),
    Variant(
        "residual_abs",
        False,
        "residual |p - q| instead of max(0, p - q)",
        lambda t, d: (t, d, rule_with(residual=lambda p, q: (p - q).abs())),
    ),
    Variant(
        "unshaped_draft_q",
        False,
        "q from the unshaped draft distribution (draft sampled shaped)",
        lambda t, d: (t, UnshapedQDrafter(d.lm), None),
        shaped=True,
    ),
    Variant(
        "target_without_top_p",
        False,
        "target p without the top-k / top-p the draft used",
        patches=((harness.core.loop, "shape_probs", target_unshaped),),
        truncating=True,
        shaped=True,
    ),
    Variant("bonus_from_draft", False, "bonus token sampled from the draft's next row", _bonus_from_draft),
    Variant(
        "bonus_wrong_row",
        False,
        "bonus token from row k-1 instead of row k",
        lambda t, d: (t, d, rule_with(bonus=lambda p, tokens: p[tokens.shape[0] - 1])),
    ),
    Variant("target_row_off_by_one", False, "x_i tested against the target row after it", lambda t, d: (t, d, _off_by_one)),
    Variant("no_rollback", False, "target cache not rolled back after a rejection", lambda t, d: (NoRollback(t), d, None)),
    Variant(
        "peeking_length",
        False,
        "draft length chosen by peeking at the target's row",
        lambda t, d: (t, PeekingDrafter(d.lm, t), None),
    ),
    Variant("no_bonus", True, "lossless: never commit a bonus token", lambda t, d: (t, d, rule_with(bonus=None))),
    Variant(
        "draft_is_target", True, "lossless: the draft is the target itself", lambda t, d: (t, ModelDrafter(copy.copy(t)), None)
    ),
    Variant(
        "prompt_lookup",
        True,
        "lossless: a model-free n-gram drafter (q a point mass)",
        lambda t, d: (t, NgramDrafter(t.vocab_size), None),
    ),
]
BROKEN = [v for v in VARIANTS if not v.lossless]
LOSSLESS = [v for v in VARIANTS if v.lossless]


@contextmanager
def plugged(variant: Variant, target, drafter):
    """(target, drafter, rule) for the loop, with the variant's patches applied (rule None: the loop's own)."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in variant.patches]
    for module, name, value in variant.patches:
        setattr(module, name, value)
    try:
        t, d, rule = variant.plug(target, drafter)
        yield t, d, (None if rule is None else per_row(rule))
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def variant_table(rows: list[tuple[str, float, str]]) -> str:
    """rows of (variant, p-value, verdict) as the table the check prints."""
    lines = [f"{'variant':<24}{'p-value':>12}  verdict", "-" * 50]

    def shown(p):  # 0: below the smallest double
        return "< 1e-300" if p == 0 else f"{p:.3g}"

    lines += [f"{name:<24}{shown(p):>12}  {verdict}" for name, p, verdict in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- batch_size > 1: rows that leak into each other


class ForgetsDroppedRows(LeanBatch):
    """When a row leaves the batch, the rows after it keep their storage where it was: each moves up
    in the batch but reads the cache row it no longer owns (another row's keys and values)."""

    def keep(self, rows):
        self.lengths = [self.lengths[i] for i in rows]


def shared_seeds(decode):
    """The batched loop with every row's generator reseeded with row 0's seed: rows draw the same
    random numbers (a per-batch instead of per-row seed). Each row's own law stays the target's;
    two rows decoding one prompt are no longer independent."""

    def run(target, drafter, prompts, k, sampling, length, eos_ids, generators, **kwargs):
        same = [torch.Generator(g.device).manual_seed(generators[0].initial_seed()) for g in generators]
        return decode(target, drafter, prompts, k, sampling, length, eos_ids, same, **kwargs)

    return run


class NoRollbackRows(LeanBatch):
    """Rows whose caches keep rejected tokens: the loop is told each row's rolled-back length, but the
    row's next step is written after the rejected entries, which attention goes on reading."""

    def start(self, rows: int, rollback: bool = True) -> None:
        super().start(rows)
        self.ends = [0] * rows  # where each row's storage really ends

    def forward(self, feeds, num_logits):
        told, self.lengths = self.lengths, self.ends
        out = super().forward(feeds, num_logits)
        self.ends, self.lengths = self.lengths, [n + f.shape[0] for n, f in zip(told, feeds)]
        return out

    def keep(self, rows):
        super().keep(rows)
        self.ends = [self.ends[i] for i in rows]
