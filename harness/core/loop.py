"""The one speculative loop, and the target-only baseline it is measured against, over a batch of rows.

Both are generators (timed per `next()` from outside) driving the same models (harness.models.batched.rows_of)
and sampler; a sequence alone is a batch of one. Cache invariant, both models, every row: after a cycle the
cache holds every committed token but the last. A cycle feeds the target, per row, [last committed,
x_1..x_k'] (the first: the whole prompt, prefill and verify in one pass) and scores k' + 1 rows, the last the
bonus row; a rollback crops both caches to the committed length minus one. A row that hits EOS or its budget
leaves the batch after its cycle. Every random draw of a row's cycle comes from its own generator, so its law
is the one-sequence law. Host reads: ONE per cycle for the whole batch (tests/test_host_syncs.py), and one per
drafted position under a draft-length policy that stops within a cycle (harness.core.lengths).

A token tree (batch of one, harness.core.tree_shapes) is the same cycle: the pass feeds [last committed, its
N nodes] with a tree mask and scores N + 1 rows, harness.core.tree walks it on the device, the one read takes
the accepted path too (the nodes, where the drafter cached them, their ranks among siblings), and both caches
keep that path only (`compact`) before the rollback. A tree's structure stays on the device (a dynamic tree's
is chosen there): still one read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from harness.core.lengths import DraftLength
from harness.core.rule import Verdicts, greedy_rows, verify_rows
from harness.core.sampling import Sampling, sample_rows, shape_probs
from harness.core.tree import verify_tree_cycle
from harness.models.batched import rows_of


@dataclass
class Cycle:
    """One draft / verify cycle of one row, as committed."""

    tokens: list[int]  # committed this cycle (accepted drafts + recovered/bonus), after stops
    num_drafted: int  # k' <= k
    num_accepted: int  # leading drafted tokens accepted and kept, 0..k' (an EOS among them ends the cycle)
    expected_acceptance: torch.Tensor  # [tested positions] beta at each: up to the first rejection, or the EOS
    num_after_eos: int = 0  # drafted tokens after an accepted EOS: never to be kept, so neither accepted nor rejected
    nodes: int = 0  # a token tree's nodes, all verified in its pass (num_drafted its depth); 0: a chain
    ranks: tuple[int, ...] = ()  # a tree's accepted nodes' places among their siblings (0: tried first)


class Rows:
    """The loop's state of the rows still decoding, one entry per row in the order the batch holds them."""

    def __init__(self, prompts: Sequence[torch.Tensor], generators: Sequence):
        self.ids = list(prompts)  # [L_i] committed so far, on the device
        self.index = list(range(len(self.ids)))  # the row each one is, among the prompts
        self.generators = list(generators)  # each row's own random stream
        self.generated = [0] * len(self.ids)
        self._tokens: list[list[int]] | None = None  # the committed ids on the host, made when first asked for

    @property
    def tokens(self) -> list[list[int]]:
        """Each row's committed ids as host ints (for prompt lookup): read once, then kept up to date."""
        if self._tokens is None:  # one transfer for every row
            flat, lengths = torch.cat(self.ids).tolist(), [ids.shape[0] for ids in self.ids]
            self._tokens = [flat[sum(lengths[:i]) : sum(lengths[: i + 1])] for i in range(len(lengths))]
        return self._tokens

    def commit(self, i: int, tokens: torch.Tensor, kept: list[int]) -> None:
        """Row i commits `kept` (its values, the host's) = tokens [len(kept)] (the same, on the device)."""
        self.ids[i] = torch.cat([self.ids[i], tokens])
        self.generated[i] += len(kept)
        if self._tokens is not None:
            self._tokens[i].extend(kept)

    def keep(self, going: list[int]) -> None:
        self.ids, self.index, self.generators, self.generated = (
            [values[i] for i in going] for values in (self.ids, self.index, self.generators, self.generated)
        )
        if self._tokens is not None:
            self._tokens = [self._tokens[i] for i in going]


def speculative_decode_rows(
    target,  # a CachedLM (or a wrapper of one), or its rows form
    drafter,  # harness.core.drafters.Drafter
    prompts: Sequence[torch.Tensor],  # B x [T_i] on the target's device
    k: int,
    sampling: Sampling,
    max_new_tokens: int,
    eos_ids: set[int],
    generators: Sequence,  # one per row (None when greedy)
    rule=verify_rows,  # tests swap in deliberately broken rules; users cannot
    tree_rule=verify_tree_cycle,
) -> Iterator[list[tuple[int, Cycle]]]:
    """Per cycle, (row, its Cycle) for every row that took part in it."""
    B = len(prompts)
    lm = rows_of(target, B)
    lm.start(B)  # the first cycle's verify pass is also the prompts' prefill
    drafter.start(list(prompts))
    reads = drafter.reads_target  # a feature head's target layers: only it costs a capture
    policy = getattr(drafter, "draft_length", None) or DraftLength()  # harness.core.lengths: k is its cap
    policy.start(B)
    rows = Rows(prompts, generators)
    while rows.ids:
        # A cycle commits at most k' + 1 tokens: draft no more than can be kept.
        budgets = policy.budgets([min(k, max_new_tokens - g - 1) for g in rows.generated])
        proposal = drafter.propose(rows, budgets, sampling)
        counts = proposal.counts
        unseen = [ids[n:] for ids, n in zip(rows.ids, lm.lengths)]  # the whole prompt in the first cycle
        feeds = [torch.cat([u, drafts[:c]]) for u, drafts, c in zip(unseen, proposal.tokens, counts)]
        wanted = [c + 1 for c in counts]
        tree = proposal.tree  # a token tree (one row): the pass sees each node's own path only
        shape = {} if tree is None else {"tree": [tree.with_prefix(unseen[0].shape[0])]}
        # per row [k'+1, V], and [u + k', F] where the drafter reads the target's features
        logits, features = (
            lm.forward_features(feeds, wanted, reads, **shape) if reads else (lm.forward(feeds, wanted, **shape), None)
        )
        scored = logits[0][None] if B == 1 else torch.nn.utils.rnn.pad_sequence(logits, batch_first=True)  # [B, K+1, V]
        drafts, facts = proposal.tokens, None  # [B, K] the drafts a verdict counts from (a tree: its accepted path's)
        if tree is not None:
            q = None if proposal.q is None else proposal.q[0]
            verdict = tree_rule(proposal.tokens[0], tree.parents, tree.widths, q, scored[0], sampling, rows.generators[0])
            path, counts = verdict.path, [len(tree.widths)]  # a tree drafts len(widths) positions
            drafts = proposal.tokens[0, path.clamp(min=0)][None]  # [1, D]
            verdicts = Verdicts(verdict.accepted[None], verdict.next_token[None], (path >= 0).float()[None])
            facts = torch.cat([path[None], tree.path_facts(path)])  # [3, D] nodes, the drafter's slots, ranks
        elif sampling.greedy:
            verdicts = greedy_rows(proposal.tokens, counts, scored.argmax(-1))
        else:
            verdicts = rule(proposal.tokens, counts, proposal.q, shape_probs(scored, sampling), rows.generators)
        accepted, committed, along = read_verdicts(drafts, verdicts, facts)  # the cycle's one host read
        if tree is not None:  # the caches keep the accepted path only, next to the committed tokens
            nodes, slots, ranks = along
            lm.compact([rows.ids[0].shape[0]], [nodes])
            drafter.keep_paths([rows.ids[0].shape[0]], [slots])
        policy.outcome(counts, accepted)
        cycles, lengths, seen, finished = [], [], [], []
        for i, (n, c) in enumerate(zip(accepted, counts)):
            length = rows.ids[i].shape[0]
            kept, stop = apply_stops(committed[i], eos_ids, max_new_tokens - rows.generated[i])
            # Positions after an EOS among the accepted drafts were never going to be kept: not tested.
            took, tested = (n, min(n + 1, c)) if len(kept) > n else (len(kept), len(kept))
            expected = verdicts.expected_acceptance[i, :tested]
            shape = {} if tree is None else {"nodes": len(tree.parents), "ranks": tuple(ranks[:took])}
            cycles.append((rows.index[i], Cycle(kept, c, took, expected, c - took if len(kept) <= n else 0, **shape)))
            lengths.append(length + n)  # the committed ids and the n accepted drafts; the next token is fed next cycle
            if reads:  # the features of the committed positions the target has now read: the unseen and the n accepted
                u = unseen[i].shape[0]
                read = features[i][: u + n] if tree is None else torch.cat([features[i][:u], features[i][u + path[:n]]])
                seen.append((read, length - u))
            tokens = torch.cat([drafts[i, :n], verdicts.next_token[i : i + 1]])  # the accepted drafts, the next token
            rows.commit(i, tokens[: len(kept)], kept)
            if stop:
                finished.append(i)
        lm.rollback(lengths)
        drafter.rollback(lengths)
        if reads:
            drafter.observe(seen)
        yield cycles
        if finished:
            going = [i for i in range(len(rows.ids)) if i not in finished]
            lm.keep(going)
            drafter.keep(going)
            rows.keep(going)
            policy.keep(going)


def read_verdicts(
    drafts: torch.Tensor, verdicts: Verdicts, along: torch.Tensor | None = None
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """The host's one read of a cycle: per row its accepted count, and its accepted drafts then the next token;
    with one row's `along` [R, D] (a tree's facts per accepted node), its R rows cut to the accepted count."""
    D = drafts.shape[1]
    parts = [verdicts.accepted[:, None], verdicts.next_token[:, None], drafts] + ([] if along is None else [along.reshape(1, -1)])
    packed = torch.cat(parts, dim=1).tolist()  # host read
    rows = [] if along is None else [packed[0][2 + D * (r + 1) : 2 + D * (r + 1) + packed[0][0]] for r in range(along.shape[0])]
    return [row[0] for row in packed], [row[2 : 2 + row[0]] + row[1:2] for row in packed], rows


def autoregressive_decode_rows(
    target, prompts: Sequence[torch.Tensor], sampling: Sampling, max_new_tokens: int, eos_ids: set[int], generators: Sequence
) -> Iterator[list[tuple[int, int]]]:
    """Target-only decoding of B rows: per step, (row, token) for every row still decoding. As in HF's
    generate(), n tokens cost one prefill (which scores the first) and n - 1 one-token steps."""
    B = len(prompts)
    lm = rows_of(target, B)
    lm.start(B, rollback=False)
    logits = torch.cat(lm.forward(list(prompts), [1] * B))  # [B, V] the row after each prompt
    active, gens = list(range(B)), list(generators)
    for step in range(max_new_tokens):
        tokens = logits.argmax(-1) if sampling.greedy else sample_rows(shape_probs(logits, sampling), gens)  # [B']
        token_ids = tokens.tolist()  # host read: the stop check needs them
        yield list(zip(active, token_ids))
        going = [i for i, t in enumerate(token_ids) if t not in eos_ids and step < max_new_tokens - 1]
        if not going:
            return
        if len(going) < len(active):
            lm.keep(going)
            active, gens = [active[i] for i in going], [gens[i] for i in going]
        logits = torch.cat(lm.forward([tokens[i : i + 1] for i in going], [1] * len(going)))  # [B', V]


def speculative_decode(
    target, drafter, prompt_ids: torch.Tensor, k, sampling: Sampling, max_new_tokens, eos_ids, generator, **rules
) -> Iterator[Cycle]:
    """One sequence (prompt_ids [T]): speculative_decode_rows with one row, its Cycles (rules: the tests' rule, tree_rule)."""
    for cycles in speculative_decode_rows(
        target, drafter, [prompt_ids], k, sampling, max_new_tokens, eos_ids, [generator], **rules
    ):
        yield cycles[0][1]


def autoregressive_decode(
    target, prompt_ids: torch.Tensor, sampling: Sampling, max_new_tokens: int, eos_ids: set[int], generator
) -> Iterator[int]:
    """One sequence (prompt_ids [T]): autoregressive_decode_rows with one row, its tokens."""
    for step in autoregressive_decode_rows(target, [prompt_ids], sampling, max_new_tokens, eos_ids, [generator]):
        yield step[0][1]


def apply_stops(tokens: list[int], eos_ids: set[int], budget: int) -> tuple[list[int], bool]:
    """Cut a cycle's tokens at the first EOS (kept) or at the token budget."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos_ids:
            return tokens[: i + 1], True
    return tokens[:budget], len(tokens) >= budget
