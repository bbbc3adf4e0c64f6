"""The KV-cached model wrapper the loop drives (CachedLM): one model, the backend that runs its forward
over a KV cache (harness.models.backend), and the verbs forward / prefill / rollback / reset. It keeps what
does not depend on the backend: the token range a model reads and scores, and the logits' width.
"""

from __future__ import annotations

import itertools
import sys

import torch
from transformers import PreTrainedModel

from harness.config.settings import COMPILED_MAX_TOKENS, HF_COMPILE_STATIC, LEAN_OWN_STORAGE
from harness.errors import HarnessError
from harness.models.backend import Backend
from harness.models.hf_backends import cache_kwarg, compile_steps, hf_backend
from harness.models.kv_store import Tree
from harness.models.lean import LeanBackend
from harness.models.lean import unsupported as lean_unsupported

__all__ = ["CachedLM", "cache_kwarg", "compile_steps"]


class CachedLM:
    """A causal LM plus its KV cache (`length` tokens cached), with the few verbs the loop needs.

    cache="dynamic" or "static" (`capacity` slots, sized by `reserve`); compile=True compiles the steps
    after a prompt; forward="hf" runs the model's own modules, "lean" harness.models.lean's forward, "auto"
    the lean one where it runs and HF's elsewhere. `copy()` makes another CachedLM of the same model.
    """

    COMPILED_MAX_TOKENS = COMPILED_MAX_TOKENS  # k + 1 for any k a sweep uses

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int,
        cache: str = "dynamic",
        max_len: int | None = None,
        compile: bool = False,
        forward: str = "hf",
    ):
        self.model = model
        self.vocab_size = vocab_size  # rows beyond it (padding) are dropped
        # A draft may score and read fewer tokens than the target produces (Gemma 3 1B beside 4B): its missing rows
        # get probability 0, ids it cannot read are fed as token 0; the rule needs only q, so the law is unchanged.
        self.scored, self.readable = _widths(model, vocab_size)
        self.device = next(model.parameters()).device
        # A composite model (Gemma 3 4B and up, Mistral 3: *ForConditionalGeneration) keeps these on its text config.
        self.text_config = model.config.get_text_config(decoder=True)
        self.context = getattr(self.text_config, "max_position_embeddings", None) or 2048
        self.cache_kwarg = cache_kwarg(model)
        self.backend = self._backend(cache == "static", min(max_len or self.context, self.context), max_len, compile, forward)

    def _backend(self, static: bool, capacity: int, max_len: int | None, compile: bool, forward: str) -> Backend:
        if forward == "lean":
            if static:
                raise HarnessError(LEAN_OWN_STORAGE)
            return LeanBackend.checked(self.model, self.cache_kwarg, max_len, capacity, compile)
        if forward == "auto" and (self.device.type == "cpu" or compile) and not (static or lean_unsupported(self.model)):
            try:  # lean where it runs: a Llama model on the CPU (measured faster), or compiled anywhere; else HF's forward
                return LeanBackend.checked(self.model, self.cache_kwarg, max_len, capacity, compile)
            except HarnessError as err:  # its logits check: HF's forward, said
                reason = str(err).split(": use")[0]
                print(f"warning: forward=auto runs HF's forward for {type(self.model).__name__}: {reason}", file=sys.stderr)
        if compile and not static:
            raise HarnessError(f"{type(self.model).__name__}: {HF_COMPILE_STATIC}")
        return hf_backend(self.model, self.cache_kwarg, static, capacity, self.context, compile)

    def copy(self, share_static_cache: bool = False) -> CachedLM:
        """The same model with an empty cache of its own. share_static_cache=True keeps a static cache shared,
        for a copy used in turns with the original, never interleaved (compiled steps are bound to its tensors)."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)  # the model and what __init__ read from it, never changed after
        other.backend = self.backend.copy(share_static_cache)
        return other

    __copy__ = copy

    # The backend's state, read (and, for tests that wrap the compiled steps, set) here.
    length = property(lambda self: self.backend.length)
    capacity = property(lambda self: self.backend.capacity)
    cache = property(lambda self: self.backend.cache)
    lean = property(lambda self: self.backend.lean)  # the LeanLlama running the steps, or None
    compiled = property(lambda self: self.backend.compiled, lambda self, step: setattr(self.backend, "compiled", step))
    graphs = property(lambda self: self.backend.graphs, lambda self, value: setattr(self.backend, "graphs", value))

    def reserve(self, max_len: int) -> None:
        """Room for sequences of up to max_len tokens (a static cache's slots, other storage allocated ahead)."""
        self.backend.reserve(max_len)

    def warm_up(self, shapes: list[tuple[int, int]], captures=((),)) -> None:
        """Compile the steps a run will take now, outside any timing: each (input tokens, logits kept) pair after a
        one-token prompt. With CUDA graphs each step runs twice (torch records a graph at its second call)."""
        if self.lean is not None:
            self.lean.warm_up(sorted({tokens for tokens, _ in shapes}), captures)
            return
        if self.compiled is None:
            return
        ids = torch.zeros(1 + max(t for t, _ in shapes), dtype=torch.long, device=self.device)
        # HF's forward breaks its graph where it records hidden states: the frames resumed after a break compile on
        # the path that reaches them, so each shape runs with and without features in both orders
        orders = [list(captures), list(captures)[::-1]] if len(captures) > 1 else [list(captures)]
        for _ in range(2 if self.graphs else 1):
            for (tokens, num_logits), order in itertools.product(shapes, orders):
                for capture in order:
                    self.reset()
                    self.forward(ids[:1])  # the prompt: eager, and it initialises the static cache
                    if capture:  # the verifies of a pair whose draft reads the target's hidden states
                        self.forward_features(ids[1 : 1 + tokens], num_logits, tuple(capture))
                    else:
                        self.forward(ids[1 : 1 + tokens], num_logits=num_logits)
        self.reset()

    @torch.inference_mode()
    def reset(self, rollback: bool = True) -> None:
        """Empty the cache: a new sequence starts. rollback=False: it will never be rolled back (the baseline)."""
        self.backend.reset(rollback)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int = 1, tree: Tree | None = None) -> torch.Tensor:
        """Append input_ids [T] to the cache; logits [num_logits, vocab_size] of the last positions. tree: the parents
        of the last len(tree) cached slots, a token tree fed in one step (Backend.forward); None: a chain."""
        return self.full_width(self.backend.forward(self.readable_ids(input_ids), num_logits, tree))

    @torch.inference_mode()
    def forward_features(
        self, input_ids: torch.Tensor, num_logits: int, layers: tuple[int, ...], tree: Tree | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, and the hidden states [T, len(layers) * hidden] at every position fed (Backend.forward_features:
        the inputs of the layers named, the final normed state for index L); for drafts that read the target."""
        logits, features = self.backend.forward_features(self.readable_ids(input_ids), num_logits, layers, tree)
        return self.full_width(logits), features

    @torch.inference_mode()
    def compact(self, base: int, kept: list[int]) -> None:
        """Move cached slots base + kept[j] (kept increasing) to base + j: a tree's accepted path made contiguous;
        then rollback(base + len(kept)) drops the rest."""
        self.backend.compact(base, kept)

    def readable_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with the ids the model cannot read as token 0 (on the device: no host read)."""
        return torch.where(input_ids < self.readable, input_ids, 0) if self.readable < self.vocab_size else input_ids

    def full_width(self, logits: torch.Tensor) -> torch.Tensor:
        """[num_logits, vocab_size]: rows beyond the range dropped, rows the model lacks -inf."""
        logits = logits[:, : self.vocab_size]  # [num_logits, scored]
        if self.scored < self.vocab_size:  # the rows a draft lacks get -inf (it can never draft them)
            return torch.nn.functional.pad(logits, (0, self.vocab_size - self.scored), value=float("-inf"))
        return logits.clone() if self.backend.output_reused else logits  # a CUDA graph's output: overwritten by its next replay

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Cache input_ids [T] (T may be 0); the logits [vocab] after the last one, if any."""
        return self.forward(input_ids, num_logits=1)[0] if input_ids.shape[0] > 0 else None

    def can_roll_back(self, length: int) -> bool:
        """Whether a rollback to `length` finds what it restores (sliding-window layers: one cycle's worth)."""
        return self.backend.can_roll_back(length)

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """Drop cached positions at and beyond `length` (rejected tokens)."""
        self.backend.rollback(length)


def _widths(model, vocab_size: int) -> tuple[int, int]:
    """(tokens the model scores, up to vocab_size; token ids it can read). A head with a vocab_size of its own
    (harness.models.shared_draft.SubsetHead) scores that many; a model without HF's embedding accessors, all."""
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return vocab_size, vocab_size
    scored = getattr(head, "vocab_size", None) or head.weight.shape[0]
    return min(vocab_size, scored), embedding.weight.shape[0]
