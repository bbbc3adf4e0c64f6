"""A fast fake language model for the exactness tests: a trigram table.

`MarkovLM` has the verbs the loop drives on a `harness.models.cached.CachedLM`
(reset, forward, prefill, rollback, length) and nothing else. Its "cache"
is the list of tokens it has been fed; the logits after position i depend
on tokens i-1 and i, so the next-token row depends on the previous TWO
tokens. That matters: with a bigram table a target that forgot to roll its
cache back would still see the right last token and give the right row,
and the missing rollback would go unnoticed. Here the stale token
left behind by a rejection changes the row, as it does in a transformer.

Everything is float64 and deterministic, a step costs a few microseconds,
and the exact law of any continuation is a product of table rows.
"""

from __future__ import annotations

import torch

from harness.models.kv_store import DeviceTree


class MarkovLM:
    """A trigram LM with the CachedLM verbs. Index `vocab_size` in the first
    table axis stands for "no token before" (the first position of a sequence)."""

    def __init__(self, table: torch.Tensor):  # [V + 1, V, V] logits[before, last, next]
        self.table = table
        self.vocab_size = table.shape[-1]
        self._rows = list(table.reshape(-1, self.vocab_size))  # row (before * V + last): views, indexed in Python (fast)
        self.device = table.device
        self.reset()

    def reset(self, rollback: bool = True) -> None:
        """Forget everything: a new sequence starts."""
        self.tokens: list[int] = []
        self.before: list[int] = []  # per position, the position whose token its row reads (-1: none)

    @property
    def length(self) -> int:
        """Tokens fed so far (the cached positions)."""
        return len(self.tokens)

    def forward(self, input_ids: torch.Tensor, num_logits: int = 1, tree: list[int] | None = None) -> torch.Tensor:
        """Append input_ids [T]; logits [num_logits, V] after each of the last positions. tree: the parents of
        the last len(tree) positions (harness.models.kv_store.tree_layout), each reading its parent's token."""
        if isinstance(tree, DeviceTree):  # read here: a test model, not a measured one
            tree = list(range(-1, tree.chain - 1)) + [p + tree.chain if p >= 0 else tree.chain - 1 for p in tree.parents.tolist()]
        tokens, v = self.tokens, self.vocab_size
        start = len(tokens)
        tokens.extend(input_ids.tolist())
        end = len(tokens)
        base = end - len(tree) if tree is not None else 0
        for i in range(start, end):  # the position each one reads before it: its parent's, or the one before
            before = i - 1 if tree is None or tree[i - base] < 0 else base + tree[i - base]
            self.before.append(before)
        rows = [
            self._rows[(tokens[self.before[i]] if self.before[i] >= 0 else v) * v + tokens[i]]
            for i in range(end - num_logits, end)
        ]
        return torch.stack(rows)  # a copy: callers may not write into the table

    def compact(self, base: int, kept: list[int]) -> None:
        """Positions base + kept[j] move to base + j (an accepted path), each then reading the one before."""
        for j, node in enumerate(kept):
            self.tokens[base + j] = self.tokens[base + node]
            self.before[base + j] = base + j - 1

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Append input_ids [T]; the logits [V] after the last one, if any."""
        return self.forward(input_ids, 1)[0] if input_ids.shape[0] else None

    def rollback(self, length: int) -> None:
        """Keep the first `length` tokens."""
        del self.tokens[length:]
        del self.before[length:]


def trigram_tables(vocab_size: int, seed: int, scale: float = 2.0, draft_noise: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, draft) logit tables [V + 1, V, V] in float64.

    The draft is the target plus Gaussian noise: close enough that most
    drafts are accepted, different enough that rejections, residual draws
    and every branch of the rule happen often.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (vocab_size + 1, vocab_size, vocab_size)
    target = scale * torch.randn(shape, generator=gen, dtype=torch.float64)
    draft = target + draft_noise * torch.randn(shape, generator=gen, dtype=torch.float64)
    return target, draft


def markov_pair(vocab_size: int = 6, seed: int = 0, scale: float = 2.0, draft_noise: float = 1.0):
    """(target MarkovLM, draft MarkovLM) over two different trigram tables."""
    target, draft = trigram_tables(vocab_size, seed, scale, draft_noise)
    return MarkovLM(target), MarkovLM(draft)
