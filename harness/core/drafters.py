"""Drafters: whatever proposes tokens for the target to verify, over a batch of rows (one row: a batch of one).

The loop (harness.core.loop) knows only the verbs of `Drafter`: `start` B new sequences; `propose` up to
budgets[i] tokens after row i's committed ids (a Proposal; fewer is fine, down to none: a plain target
step); `observe` the target's hidden states at the committed positions (only a drafter that
`reads_target`); `keep_paths` after a token tree, the accepted nodes it cached; `rollback` to the first
lengths[i] tokens of what row i has seen; `keep` these rows. The runner also asks `reserve`, `warm_up`, `use_costs`, `models`, `context`, `size` and `forwards`.
harness.runner.pair.load_pair is the one place that knows the classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from harness.base.host_reads import from_host
from harness.core.lengths import DraftLength
from harness.core.sampling import Sampling, sample_rows, shape_probs
from harness.core.tree_shapes import TreeShape, TreeSpec, grow
from harness.models.batched import resized, rows_of
from harness.models.eagle import FeatureHead, HeadRows

if TYPE_CHECKING:
    from harness.core.loop import Rows
    from harness.models.cached import CachedLM


@dataclass
class Proposal:
    """What a batch's rows drafted in a cycle."""

    tokens: torch.Tensor  # [B, K] row i's first counts[i] real, the rest 0
    counts: list[int]  # [B] tokens row i drafted (host ints: the drafter knows them without a read)
    q: torch.Tensor | None  # [B, K, V] the laws row i's drafts were drawn from; None when greedy, none drafted or one-hot
    tree: TreeShape | None = None  # a token tree (one row): its K nodes' parents; None: a chain

    @staticmethod
    def cut(tokens: torch.Tensor, counts: list[int], q: torch.Tensor | None) -> Proposal:
        """tokens [B, K] and q [B, K, V] cut to the longest row's count (a policy may stop every row early)."""
        K = max(counts, default=0)
        if K == tokens.shape[1]:
            return Proposal(tokens, counts, q)
        return Proposal(tokens[:, :K], counts, None if q is None else q[:, :K])


def draw_into(tokens: torch.Tensor, q: torch.Tensor | None, at, j: int, logits: torch.Tensor, sampling: Sampling, generators):
    """Draft token j of the rows `at` from their logits [B', V] into tokens [B, K] (the argmax when greedy, else
    a sample from q with each row's generator), and its law into q [B, K, V] (made at the first draw): q."""
    if sampling.greedy:
        tokens[at, j] = logits.argmax(-1)
        return q
    probs = shape_probs(logits, sampling)  # [B', V]
    tokens[at, j] = sample_rows(probs, generators)
    q = probs.new_zeros(*tokens.shape, probs.shape[-1]) if q is None else q
    q[at, j] = probs
    return q


def own_probabilities(tokens: torch.Tensor, q: torch.Tensor | None, at, j: int, logits: torch.Tensor, sampling: Sampling):
    """The draft's probability of its token j in the rows `at` (under q when sampling, its softmax when greedy),
    read to the host: what a stopping draft-length policy decides on. One host read."""
    if sampling.greedy:
        p = logits.float().softmax(-1).amax(-1)  # [B']
    else:
        p = q[at, j].gather(-1, tokens[at, j][:, None])[:, 0]  # [B']
    return p.tolist()


def stop_where_told(policy: DraftLength, live: list[int], budgets: list[int], j: int, probabilities: list[float]) -> None:
    """Each live row that drafted token j and whose policy says stop gets budget j + 1 (in place)."""
    for i, p in zip(live, probabilities):
        if not policy.go_on(i, p):
            budgets[i] = j + 1


class Drafter(Protocol):
    kind: str
    reads_target: tuple[int, ...]
    forwards: bool
    draft_length: DraftLength  # how many tokens a row drafts (harness.core.lengths), consulted by propose

    def start(self, prompts: list[torch.Tensor]) -> None: ...
    def propose(self, rows: Rows, budgets: list[int], sampling: Sampling) -> Proposal: ...
    def observe(self, seen: list[tuple[torch.Tensor, int]]) -> None: ...
    def keep_paths(self, bases: list[int], slots: list[list[int]]) -> None: ...
    def rollback(self, lengths: list[int]) -> None: ...
    def keep(self, rows: list[int]) -> None: ...


class DrafterBase:
    """What a drafter does when it has nothing to do: no features read, no storage, no costs used."""

    kind = ""  # what drafts: "model", "feature head" or "prompt lookup" (how the exactness check replays it)
    reads_target: tuple[int, ...] = ()
    forwards = True  # each drafted token costs a forward pass of the draft
    context: int | None = None  # the longest sequence the draft takes (None: no limit of its own)

    tree: TreeSpec | None = None  # token trees (harness.core.tree_shapes), at batch size 1; None: chains

    def observe(self, seen) -> None: ...
    def keep_paths(self, bases: list[int], slots: list[list[int]]) -> None: ...
    def reserve(self, positions: int, rows: int = 1) -> None: ...
    def warm_up(self, k: int, rows: int = 1) -> None: ...
    def use_costs(self, costs: dict) -> None: ...

    def models(self) -> list:
        return []

    def size(self, target_model) -> dict:
        return {"draft_params": 0, "draft_bytes": 0}


class ModelDrafter(DrafterBase):
    """A small causal LM drafting autoregressively with its own KV cache, every row in one pass per step.
    A proposal first feeds each row what it has not seen (last cycle's commits), then its own drafts one
    at a time, never its last (caught up next cycle if accepted). No host read."""

    kind = "model"

    def __init__(self, lm: CachedLM):
        self.lm, self.draft_length = lm, DraftLength()
        self.rows = None  # the lm as the rows of the current batch (harness.models.batched.rows_of)

    @property
    def context(self) -> int:
        return self.lm.context

    def start(self, prompts) -> None:
        self.rows = rows_of(self.lm, len(prompts))
        self.rows.start(len(prompts))
        self.rows.forward([p[:-1] for p in prompts], [0] * len(prompts))

    def propose(self, rows, budgets, sampling):
        if self.tree is not None and budgets[0]:
            return self._tree(rows, budgets[0], sampling)
        K, B, device, budgets = max(budgets, default=0), len(budgets), self.lm.device, list(budgets)
        tokens, q = torch.zeros(B, K, dtype=torch.long, device=device), None
        feeds = [ids[n:] if b else ids[:0] for ids, n, b in zip(rows.ids, self.rows.lengths, budgets)]
        for step in range(K):
            drafting = [i for i, b in enumerate(budgets) if b > step]
            if not drafting:  # every row stopped early (a stopping draft-length policy)
                break
            at = slice(None) if len(drafting) == B else drafting  # every row: a slice, no index tensor made
            logits = self.rows.forward(feeds, [int(b > step) for b in budgets])  # per row [1 or 0, V]
            scored = logits[0] if B == 1 else torch.cat([logits[i] for i in drafting])  # [B', V]
            q = draw_into(tokens, q, at, step, scored, sampling, [rows.generators[i] for i in drafting])
            if self.draft_length.stops:  # every drafted token's probability: the policy calibrates on them all
                stop_where_told(
                    self.draft_length, drafting, budgets, step, own_probabilities(tokens, q, at, step, scored, sampling)
                )
            feeds = [tokens[i, step : step + 1] if b > step + 1 else rows.ids[i][:0] for i, b in enumerate(budgets)]
        return Proposal.cut(tokens, budgets, q)

    def _tree(self, rows, depth: int, sampling) -> Proposal:
        """One row's token tree of up to `depth` levels, each level one pass of the draft over its nodes."""
        feed = rows.ids[0][self.rows.lengths[0] :]
        root = self.rows.forward([feed], [1])[0]  # [1, V]

        def expand(first, tokens, tree):  # the level's nodes, below their parents among the nodes fed so far
            return self.rows.forward([tokens], [tokens.shape[0]], tree=[tree])[0]  # [n, V]

        tokens, q, shape = grow(self.tree, depth, root, expand, sampling, rows.generators[0])
        return Proposal(tokens[None], [tokens.shape[0]], None if q is None else q[None], shape)

    def keep_paths(self, bases, slots) -> None:
        """After a tree: the accepted nodes it fed (slots[0]: where it cached each, -1: not fed) move next to the
        committed tokens; the rest is dropped."""
        kept = [slot for slot in slots[0] if slot >= 0]
        self.rows.compact(bases, [kept])
        self.rows.rollback([bases[0] + len(kept)])

    def rollback(self, lengths) -> None:
        self.rows.rollback(lengths)

    def keep(self, rows) -> None:
        self.rows.keep(rows)

    def reserve(self, positions: int, rows: int = 1) -> None:
        self.lm.reserve(positions)
        if rows > 1:
            rows_of(self.lm, rows).reserve(positions, rows)

    def warm_up(self, k: int, rows: int = 1) -> None:
        """With compile=true: its one-token steps and two-token catch-up (last draft + bonus)."""
        rows_of(self.lm, rows).warm_up([(1, 1), (2, 1)])

    def models(self) -> list:
        return [self.lm.model]

    def size(self, target_model) -> dict:
        shared = {id(p) for p in target_model.parameters()}
        own = [p for p in self.lm.model.parameters() if id(p) not in shared]
        return {"draft_params": sum(p.numel() for p in own), "draft_bytes": sum(p.numel() * p.element_size() for p in own)}


class FeatureDrafter(DrafterBase):
    """A feature head (harness.models.eagle.FeatureHead) drafting from the target's hidden states, its passes
    batched over the rows (harness.models.eagle.HeadRows). Pair i reads the target's feature at position i
    and the committed token i + 1. A proposal feeds each row the pairs it has not seen, up to pair L-2 of L
    committed tokens, then its own output and each draft. `rollback` drops every drafted pair, so accepted
    drafts are read again with the target's features. A row's first cycle drafts nothing. No host read."""

    kind = "feature head"

    def __init__(self, head: FeatureHead, store=None, compile: bool = False):
        self.head, self.compile, self.draft_length = head, compile, DraftLength()
        self.reads_target = tuple(head.reads)  # the target layers whose features it reads
        self.capacity = 0
        self.store = store if store is not None else HeadRows(head, 1, compile=compile)  # its KV storage, for a batch's rows

    def reserve(self, positions: int, rows: int = 1) -> None:
        self.capacity = max(self.capacity, positions)
        self.store = resized(self.store, rows, self.compile, lambda n: HeadRows(self.head, n, self.capacity, self.compile))
        self.store.reserve(self.capacity)

    def warm_up(self, k: int, rows: int = 1) -> None:
        """With compile=true: its steps over 1..k+1 pairs read from the target, and its one-pair drafting steps."""
        self.reserve(self.capacity, rows)
        self.store.warm_up(list(range(1, k + 2)))

    def start(self, prompts) -> None:
        self.reserve(self.capacity, len(prompts))
        self.store.lengths = [0] * len(prompts)
        self.features: list[torch.Tensor | None] = [None] * len(prompts)  # per row [capacity, F]
        self.known = [0] * len(prompts)  # per row: committed positions whose features it holds
        self.pairs = [0] * len(prompts)  # per row: pairs in the head's cache built on the target's features

    def observe(self, seen) -> None:
        """Per row, (features [n, F] of committed positions start.., start): written into the row's store
        [capacity, F] of committed positions' features (the first known[i] valid), grown as needed."""
        for i, (features, start) in enumerate(seen):
            if start > self.known[i]:  # a target that kept a prefix it read before this sequence began
                raise RuntimeError(
                    f"a feature head needs the target to read every position: features from {start}, known to {self.known[i]}"
                )
            store, end = self.features[i], start + features.shape[0]
            if store is None or end > store.shape[0]:
                grown = features.new_empty(max(end, 2 * (0 if store is None else store.shape[0]), 256), features.shape[1])
                if store is not None:
                    grown[:start] = store[:start]
                store = grown
            store[start:end] = features
            self.features[i], self.known[i] = store, end

    def propose(self, rows, budgets, sampling):
        lengths = [ids.shape[0] for ids in rows.ids]
        B, device = len(budgets), rows.ids[0].device
        drafting = [b > 0 and n >= 2 and known >= n - 1 for b, n, known in zip(budgets, lengths, self.known)]
        if not any(drafting):
            return Proposal(torch.zeros(B, 0, dtype=torch.long, device=device), [0] * B, None)
        if self.tree is not None:
            return self._tree(rows, lengths, budgets[0], sampling)
        counts = [b if d else 0 for b, d in zip(budgets, drafting)]
        tokens, q = torch.zeros(B, max(counts), dtype=torch.long, device=device), None  # [B, K]
        logits, last = self._read_target(rows.ids, lengths, drafting)  # [B, V], [B, H]
        self.pairs = [n - 1 if d else p for n, d, p in zip(lengths, drafting, self.pairs)]
        for j in range(tokens.shape[1]):
            live = [i for i, c in enumerate(counts) if c > j]
            if not live:  # every row stopped early (a stopping draft-length policy)
                break
            at = slice(None) if len(live) == B else live  # every row: a slice, no index tensor made
            q = draw_into(tokens, q, at, j, logits[at], sampling, [rows.generators[i] for i in live])
            if self.draft_length.stops:  # every drafted token's probability: the policy calibrates on them all
                stop_where_told(self.draft_length, live, counts, j, own_probabilities(tokens, q, at, j, logits[at], sampling))
            going = [int(c > j + 1) for c in counts]
            if any(going):
                logits, out = self.store.step(tokens[:, j : j + 1], last[:, None], going, from_target=False)
                last = out[:, 0]
        return Proposal.cut(tokens, counts, q)

    def _tree(self, rows, lengths, depth: int, sampling) -> Proposal:
        """One row's token tree of up to `depth` levels: each level's nodes one pass of the head, every node
        reading its parent's output (the root's: the head's output at the last committed pair)."""
        root, last = self._read_target(rows.ids, lengths, [True])  # [1, V], [1, H]
        self.pairs = [lengths[0] - 1]
        outputs = [last]  # row 0 the root's output, row i + 1 node i's (fed breadth first)

        def expand(first, tokens, tree):
            n = tokens.shape[0]
            above = tree.parents[first:] + 1  # [n] rows of `outputs`
            logits, out = self.store.step(
                tokens[None], torch.cat(outputs)[above][None], [n], from_target=False, tree=tree
            )  # [n, V], [1, n, H]
            outputs.append(out[0])
            return logits

        tokens, q, shape = grow(self.tree, depth, root, expand, sampling, rows.generators[0])
        return Proposal(tokens[None], [tokens.shape[0]], None if q is None else q[None], shape)

    def _read_target(self, ids, lengths, drafting):
        """Feed each drafting row the pairs it has not seen, built on the target's features: the logits
        [B, V] of each row's last pair and its output [B, H] (rows not drafting: garbage)."""
        starts = self.store.lengths
        counts = [n - 1 - s if d else 0 for n, s, d in zip(lengths, starts, drafting)]
        if len(ids) == 1:  # one row: views of its ids and features
            (s,), (c,) = starts, counts
            logits, out = self.store.step(
                ids[0][None, s + 1 : s + 1 + c], self.features[0][None, s : s + c], counts, from_target=True
            )
            return logits, out[:, c - 1]
        width, some = max(counts), self.features[drafting.index(True)]
        feed = ids[0].new_zeros(len(ids), width)  # [B, T]
        hidden = some.new_zeros(len(ids), width, some.shape[1])  # [B, T, F]
        for i, (c, s) in enumerate(zip(counts, starts)):
            if c:
                feed[i, :c], hidden[i, :c] = ids[i][s + 1 : s + 1 + c], self.features[i][s : s + c]
        logits, out = self.store.step(feed, hidden, counts, from_target=True)  # [B, V], [B, T, H]
        last = out[torch.arange(len(ids), device=out.device), from_host([max(c, 1) - 1 for c in counts], out.device)]  # [B, H]
        return logits, last

    def rollback(self, lengths) -> None:
        self.store.lengths = [min(n, p, length - 1) for n, p, length in zip(self.store.lengths, self.pairs, lengths)]

    def keep(self, rows) -> None:
        self.store.keep_rows(rows)
        self.features, self.known, self.pairs = ([values[i] for i in rows] for values in (self.features, self.known, self.pairs))

    def size(self, target_model) -> dict:
        own = list(self.head.parameters()) + list(self.head.buffers())  # the target's embedding and LM head are not registered
        params = sum(p.numel() for p in self.head.parameters())
        return {"draft_params": params, "draft_bytes": sum(p.numel() * p.element_size() for p in own)}


class NgramDrafter(DrafterBase):
    """Model-free prompt lookup, per row (`lookup`), on the host's copy of the committed tokens. Its q is a
    point mass on each proposal, so the rule stays exact. It proposes the whole match, up to the row's
    budget (as HF's prompt_lookup_num_tokens), cut where a stopping draft-length policy says so (`cost`:
    harness.core.lengths), which it asks at each position with the row's acceptance so far at that n-gram
    length (`LookupRow`) as its probability."""

    kind = "prompt lookup"
    forwards = False

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.draft_length = DraftLength()
        self.start([None])

    def start(self, prompts) -> None:
        self.state = [LookupRow(self.max_ngram) for _ in prompts]

    def propose(self, rows, budgets, sampling):
        proposed = []
        for i, (state, tokens, budget) in enumerate(zip(self.state, rows.tokens, budgets)):
            n, found = lookup(tokens, budget, self.max_ngram, self.min_ngram)
            if found and self.draft_length.stops:
                a = state.acceptance(n)
                found = found[: next((j + 1 for j in range(len(found)) if not self.draft_length.go_on(i, a)), len(found))]
            state.pending = (n, len(tokens), len(found)) if found else None
            proposed.append(found)
        counts = [len(found) for found in proposed]
        K, device = max(counts, default=0), rows.ids[0].device
        tokens = from_host([t for found in proposed for t in found + [0] * (K - len(found))], device).view(len(counts), K)
        if K == 0 or sampling.greedy:
            return Proposal(tokens, counts, None)
        valid = torch.arange(K, device=device) < from_host(counts, device)[:, None]  # [B, K]
        q = torch.zeros(len(counts), K, self.vocab_size, device=device)
        q.scatter_(-1, tokens[..., None], valid[..., None].float())  # a point mass on each drafted token
        return Proposal(tokens, counts, q)

    def rollback(self, lengths) -> None:
        for state, length in zip(self.state, lengths):
            state.outcome(length)

    def keep(self, rows) -> None:
        self.state = [self.state[i] for i in rows]


class LookupRow:
    """One row's prompt-lookup acceptance so far, per n-gram length: what a stopping policy weighs a match by."""

    def __init__(self, max_ngram: int):
        self.accepted = [1.0] * (max_ngram + 1)  # pseudo-counts of a 1/2 prior
        self.tested = [2.0] * (max_ngram + 1)
        self.pending: tuple[int, int, int] | None = None  # (n, committed length, proposed) of the last proposal

    def acceptance(self, n: int) -> float:
        return self.accepted[n] / self.tested[n]

    def outcome(self, length: int) -> None:
        """The last proposal's outcome: length - committed of it were accepted."""
        if self.pending is not None:
            n, committed, proposed = self.pending
            accepted = length - committed
            self.accepted[n] += accepted
            self.tested[n] += min(accepted + 1, proposed)
            self.pending = None


def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """(n, the up to k tokens after the latest earlier match of the last n tokens); n = 0: none. A match
    that runs into the end continues as a repeat ("7 7 7", "a b a b" get k tokens, not one period)."""
    if k == 0:
        return 0, []
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = tokens[-n:]
        for at in range(length - n - 1, -1, -1):  # the latest match: most recent context
            if tokens[at : at + n] == tail:
                start = at + n
                period = length - start  # >= 1
                return n, [tokens[start + j % period] for j in range(k)]
    return 0, []
