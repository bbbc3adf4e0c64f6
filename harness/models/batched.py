"""A batch of sequences of one model, each row with a length of its own (batch_size > 1).

`BatchedLM` is what the loop drives: a ragged forward (rows feed different counts, right-padded to the
longest), a rollback to per-row lengths, and `keep` to drop finished rows. Layouts: `LeanBatch` (lean
KV storage written at each row's own positions: a rollback only moves a length, padding is never read)
and `HFBatch` (one DynamicCache length for all rows, padding and rolled-back slots hidden by the mask).
Either way a row's logits are those of its own tokens alone (to rounding). HF's static cache and
compiled steps, and sliding-window models, run one sequence at a time (`OneRow`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from harness.config.settings import BATCH_ONE_ONLY
from harness.errors import HarnessError
from harness.models.cached import CachedLM

TREES_ONE_ROW = "token trees run at batch_size=1 (one sequence, OneRow): use batch_size=1, or feed chains (drop `tree`)"


class BatchedLM:
    """B sequences of one model (`lm`, a CachedLM), decoded together; `lengths[i]`: positions cached for row i (host ints)."""

    layout = ""  # how rows of different lengths share the batch, recorded in a run's conditions

    def __init__(self, lm: CachedLM):
        self.lm, self.device, self.vocab_size = lm, lm.device, lm.vocab_size
        self.lengths: list[int] = []

    def start(self, rows: int, rollback: bool = True) -> None:
        """Empty caches for `rows` new sequences (rollback=False: they will never be rolled back)."""
        raise NotImplementedError

    def reserve(self, max_len: int, rows: int = 1) -> None:
        """Room for `rows` sequences of up to max_len positions (where storage is allocated ahead)."""

    def warm_up(self, shapes: list[tuple[int, int]], captures=((),)) -> None:
        """With compile=true: compile the steps of these shapes for the reserved rows now (as CachedLM.warm_up)."""

    def forward(self, feeds: list[torch.Tensor], num_logits: list[int], tree: list | None = None) -> list[torch.Tensor]:
        """Append feeds[i] [T_i] (T_i may be 0) to active row i; per row the logits [num_logits[i], V]
        of its last positions (num_logits[i] <= T_i). tree: per row a token tree (CachedLM.forward) or None;
        only OneRow runs trees."""
        refuse_trees(tree)
        return self._step(feeds, num_logits, ())[0]

    def forward_features(
        self, feeds: list[torch.Tensor], num_logits: list[int], layers: tuple[int, ...], tree: list | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """As forward, and per row the hidden states [T_i, len(layers) * hidden] of its fed positions."""
        refuse_trees(tree)
        logits, features = self._step(feeds, num_logits, layers)  # features [B, T, F]
        return logits, [row[: f.shape[0]] for row, f in zip(features, feeds)]

    def compact(self, bases: list[int], kept: list[list[int]]) -> None:
        """Move row i's slots bases[i] + kept[i][j] to bases[i] + j: a tree's accepted path (OneRow only)."""
        raise HarnessError(TREES_ONE_ROW)

    def _step(self, feeds, num_logits, layers) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """A step of `forward`: per row its logits, and the features [B, T, F] of `layers` (None without)."""
        raise NotImplementedError

    def rollback(self, lengths: list[int]) -> None:
        """Drop each active row's positions at and beyond lengths[i]."""
        self.lengths = [min(a, b) for a, b in zip(self.lengths, lengths)]

    def keep(self, rows: list[int]) -> None:
        """Only the active rows `rows` (indices into the active rows, in order) go on."""
        self.lengths = [self.lengths[i] for i in rows]

    def _padded(self, feeds: list[torch.Tensor]) -> torch.Tensor:
        """feeds as one [B, T] tensor, right-padded with token 0 to the longest (T >= 1)."""
        ids = torch.zeros(len(feeds), max(1, max(f.shape[0] for f in feeds)), dtype=torch.long, device=self.device)
        for row, f in enumerate(feeds):
            ids[row, : f.shape[0]] = self.lm.readable_ids(f)
        return ids

    def _split(self, logits: torch.Tensor, num_logits: list[int]) -> list[torch.Tensor]:
        """The rows' logits [N, V'] (full vocabulary width) split by row."""
        return list(self.lm.full_width(logits).split(num_logits))


class LeanBatch(BatchedLM):
    """The lean forward with ragged KV storage: row i's positions live at 0..lengths[i]-1 of its own row."""

    layout = "ragged: KV storage per row at its own positions, steps right-padded to the longest feed"

    def __init__(self, lm: CachedLM):
        super().__init__(lm)
        self.lean = lm.lean.like(1)
        self.max_len = 0

    def start(self, rows: int, rollback: bool = True) -> None:
        self.reserve(self.max_len or 1, rows)
        self.lengths = [0] * rows

    def reserve(self, max_len: int, rows: int = 1) -> None:
        self.lean = resized(self.lean, rows, self.lean.captured is not None, self.lm.lean.like)
        self.max_len = max(self.max_len, max_len)
        self.lean.reserve(self.max_len)

    def warm_up(self, shapes, captures=((),)):
        self.lean.warm_up(sorted({tokens for tokens, _ in shapes}), captures)

    def _step(self, feeds, num_logits, layers):
        counts = [f.shape[0] for f in feeds]
        out = self.lean.forward(self._padded(feeds), self.lengths, num_logits, counts, layers)  # [N, V'] (, [B, T, F])
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        logits, features = out if layers else (out, None)
        return self._split(logits, num_logits), features

    def keep(self, rows):
        self.lean.keep_rows(list(rows))
        super().keep(rows)


class HFBatch(BatchedLM):
    """HF's modules on a DynamicCache of one common length, holes masked (`held` [B, C]: slot holds a token of its row)."""

    layout = "padded: one DynamicCache length for all rows, padding and rolled-back slots hidden by the attention mask"

    def __init__(self, lm: CachedLM):
        super().__init__(lm)
        config = lm.text_config
        if getattr(config, "sliding_window", None) and any(
            t != "full_attention" for t in (getattr(config, "layer_types", None) or ["sliding_attention"])
        ):
            raise HarnessError(
                f"{type(lm.model).__name__} has sliding-window layers, which batch_size > 1 does not roll back: use batch_size=1"
            )
        self.cache: DynamicCache | None = None
        self.held = torch.zeros(0, 0, dtype=torch.bool, device=self.device)

    def start(self, rows: int, rollback: bool = True) -> None:
        self.cache = DynamicCache(config=self.lm.model.config)
        self.held = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        self.lengths = [0] * rows

    def _step(self, feeds, num_logits, layers):
        ids = self._padded(feeds)
        columns = torch.arange(ids.shape[1], device=self.device)  # [T]
        real = torch.tensor([f.shape[0] for f in feeds], device=self.device)[:, None] > columns  # [B, T]
        positions = torch.tensor(self.lengths, device=self.device)[:, None] + columns  # [B, T]
        # This step's padding attends (to itself, at least: never a row with nothing to attend to); later steps do not see it.
        mask = torch.cat([self.held, torch.ones_like(real)], dim=1).long()  # [B, C + T]
        # [N, 2] (row, index in the padded feed) of every logit row asked for, row by row
        last = [(row, t) for row, (f, n) in enumerate(zip(feeds, num_logits)) for t in range(f.shape[0] - n, f.shape[0])]
        last = torch.tensor(last, dtype=torch.long, device=self.device).reshape(-1, 2)
        kept, where = last[:, 1].unique(return_inverse=True)  # the positions any row wants logits of: those only
        options = {self.lm.cache_kwarg: self.cache, "use_cache": True, "logits_to_keep": kept if kept.numel() else 1}
        out = self.lm.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=bool(layers), **options
        )
        self.held = torch.cat([self.held, real], dim=1)
        self.lengths = [n + f.shape[0] for n, f in zip(self.lengths, feeds)]
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1) if layers else None  # [B, T, F]
        return self._split(out.logits[last[:, 0], where], num_logits), features

    def rollback(self, lengths):
        counts = self.held.cumsum(1)  # [B, C] tokens of its row up to each slot
        self.held &= counts <= torch.tensor(lengths, device=self.device)[:, None]
        super().rollback(lengths)
        used = self.held.any(0).nonzero()
        end = int(used[-1]) + 1 if used.numel() else 0
        if end < self.held.shape[1]:  # the slots past every row's last token go
            self.cache.crop(end - self.held.shape[1])
            self.held = self.held[:, :end]

    def keep(self, rows):
        if rows != list(range(self.held.shape[0])):
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.cache.batch_select_indices(index)
            self.held = self.held[index]
        super().keep(rows)


class OneRow(BatchedLM):
    """One sequence: the CachedLM's own forward (any backend) behind the rows interface: a batch of one."""

    layout = "one row"

    def __init__(self, lm):
        self.lm, self.device, self.vocab_size = lm, lm.device, lm.vocab_size

    @property
    def lengths(self) -> list[int]:
        return [self.lm.length]

    def start(self, rows: int, rollback: bool = True) -> None:
        assert rows == 1, "OneRow holds one sequence"
        if rollback:
            self.lm.reset()
        else:
            self.lm.reset(rollback=False)

    def forward(self, feeds, num_logits, tree=None):
        (feed,), (n,), options = feeds, num_logits, _tree(tree)
        if n == 0:  # cached, nothing scored (a draft's prompt)
            if not options:
                self.lm.prefill(feed)
            elif feed.shape[0]:
                self.lm.forward(feed, num_logits=1, **options)
            return [torch.empty(0, self.vocab_size, device=self.device)]
        return [self.lm.forward(feed, num_logits=n, **options)]

    def forward_features(self, feeds, num_logits, layers, tree=None):
        (feed,), (n,) = feeds, num_logits
        logits, features = self.lm.forward_features(feed, max(n, 1), layers, **_tree(tree))
        return [logits[logits.shape[0] - n :]], [features]

    def compact(self, bases, kept) -> None:
        self.lm.compact(bases[0], kept[0])

    def rollback(self, lengths) -> None:
        self.lm.rollback(lengths[0])

    def warm_up(self, shapes, captures=((),)) -> None:
        self.lm.warm_up(shapes, captures)

    def keep(self, rows) -> None:
        assert list(rows) in ([], [0]), rows


def refuse_trees(tree: list | None) -> None:
    """A batch form refuses token trees (HarnessError): they run one sequence at a time."""
    if tree is not None and any(row is not None for row in tree):
        raise HarnessError(TREES_ONE_ROW)


def _tree(tree: list | None) -> dict:
    """OneRow's one row's tree as keyword arguments: none without (wrappers of a CachedLM may take no tree)."""
    return {} if tree is None or tree[0] is None else {"tree": tree[0]}


def resized(storage, rows: int, compiled: bool, make):
    """`storage` (with `.rows`) or, where `rows` needs new storage, make(rows): more rows, or fewer unless
    compiled (compiled steps run fewer rows padded; new storage is compiled anew at warm-up)."""
    return make(rows) if rows > storage.rows or rows < storage.rows and not compiled else storage


def batched(lm: CachedLM) -> BatchedLM:
    """The batched form of a CachedLM: the lean layout where it runs the lean forward, HF's otherwise."""
    if lm.lean is not None:
        return LeanBatch(lm)
    if lm.compiled is not None or lm.backend.cache is not None and not isinstance(lm.backend.cache, DynamicCache):
        raise HarnessError(BATCH_ONE_ONLY)
    return HFBatch(lm)


def rows_of(lm, rows: int) -> BatchedLM:
    """`lm` (a CachedLM, or a wrapper of one) as `rows` sequences: OneRow for one, else its batched form,
    made once per CachedLM (its storage kept from batch to batch)."""
    if isinstance(lm, BatchedLM):
        return lm
    lean = getattr(lm, "lean", None)  # (a model of the tests' own kind may have none)
    if rows == 1 and (lean is None or lean.captured is None or "batch_form" not in lm.__dict__):
        return OneRow(lm)  # (a compiled batch form runs a last batch of one among its padded rows: no new shape)
    if lm.__dict__.get("batch_form") is None:
        lm.__dict__["batch_form"] = batched(lm)
    return lm.__dict__["batch_form"]
