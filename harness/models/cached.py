"""The KV-cached model wrapper the loop drives (CachedLM): one model, its cache, and the
verbs forward / prefill / rollback / reset. Backends: HF modules with a dynamic or static
cache (optionally compiled), or the lean forward (harness.models.lean)."""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from harness.config.checks import COMPILED_MAX_TOKENS, LEAN_EAGER_ONLY
from harness.core.host_syncs import unwatched
from harness.errors import HarnessError
from harness.models.kv_cache import GrowingLayer, in_place
from harness.models.lean import LeanLlama
from harness.models.lean import check as lean_check
from harness.models.lean import unsupported as lean_unsupported


class CachedLM:
    """A causal LM plus its KV cache, with the few verbs the loop needs.

    `length` is the number of tokens whose keys and values are cached. The
    loop keeps the cache one token behind the committed sequence: the last
    committed token is fed with the next forward, which yields its logits.

    Two caches: `dynamic` (HF DynamicCache, its full-attention layers
    written in place by `harness.models.kv_cache.GrowingLayer` rather than grown by
    concatenation; rollback moves their length) and `static` (HF StaticCache of `capacity` slots, allocated once; positions
    are written by index and rollback only moves `length` back, the causal
    mask hiding the stale slots beyond it, as gpt-fast does). Attention reads
    every slot of a static cache, so `reserve` sizes it to the longest
    sequence a run needs rather than the model's whole context.

    `compile=True` (with the static cache: fixed shapes) runs the forwards of
    decoding, drafting and verifying (after the prompt, at most
    COMPILED_MAX_TOKENS tokens) through `torch.compile`; a prompt's forward,
    whose length varies, runs eagerly so that each new prompt length does not
    cost a recompilation.
    """

    COMPILED_MAX_TOKENS = COMPILED_MAX_TOKENS  # k + 1 for any k a sweep uses (harness.config.checks refuses larger k with compile=true)

    def __init__(self, model: PreTrainedModel, vocab_size: int, cache: str = "dynamic", max_len: int | None = None,
                 compile: bool = False, forward: str = "hf"):
        self.model = model
        self.vocab_size = vocab_size  # rows beyond it (padding) are dropped
        # A draft may score and read fewer tokens than the target can produce (Gemma 3 1B beside 4B and up, whose
        # range adds the image token): its missing rows get probability 0, and ids it cannot read are fed to it as
        # token 0. Neither changes the committed law: the rule needs only q, the law the drafts were drawn from.
        self.scored, self.readable = _widths(model, vocab_size)
        self.device = next(model.parameters()).device
        self.static = cache == "static"
        # A composite model (Gemma 3 4B and up, Mistral 3: *ForConditionalGeneration) keeps these on its text config.
        self.text_config = model.config.get_text_config(decoder=True)
        self.context = getattr(self.text_config, "max_position_embeddings", None) or 2048
        self.capacity = min(max_len or self.context, self.context)
        if self.static:
            self.cache = StaticCache(config=model.config, max_cache_len=self.capacity)  # `reserve` sizes it for a run
            if compile and any(self.cache.is_sliding):
                raise HarnessError(f"{type(model).__name__} has sliding-window layers, whose static cache (transformers' "
                                   f"StaticSlidingWindowLayer) compiles a new graph at every length: use compile=false")
        self.graphs = compile and self.device.type == "cuda"  # CUDA graphs (mode="reduce-overhead"): see warm_up
        self.compiled = _compile(model, "reduce-overhead" if self.graphs else None) if compile else None
        self.cache_kwarg = cache_kwarg(model)
        self.cache_checked = False  # the first prompt checks that the model really filled the cache
        self.lean: LeanLlama | None = None  # forward=lean: harness/lean.py runs the steps, with KV storage of its own
        if forward == "lean":
            if self.static or compile:
                raise HarnessError(LEAN_EAGER_ONLY)
            self.lean = self._checked_lean(max_len)
        elif forward == "auto" and self.device.type == "cpu" and not (self.static or compile or lean_unsupported(model)):
            try:  # lean where it runs and was measured faster: a Llama model, eager, on the CPU; else HF's forward
                self.lean = self._checked_lean(max_len)
            except HarnessError as err:  # its logits check: HF's forward, said
                print(f"warning: forward=auto runs HF's forward for {type(model).__name__}: {str(err).split(': use')[0]}", file=sys.stderr)
        self.growing: dict[int, GrowingLayer] = {}  # the dynamic cache's in-place layers, kept across sequences
        self.reset()

    def _checked_lean(self, max_len: int | None) -> LeanLlama:
        """The lean forward of this model, refused (HarnessError) if its logits are not HF's."""
        lean = LeanLlama(self.model)
        lean_check(lean, self.cache_kwarg)
        lean.reserve(max_len or 1)
        return lean

    def __copy__(self) -> "CachedLM":
        """The same model with a cache of its own (the draft-is-target control drafts with a copy
        of the target): a shallow copy would share the cache and its in-place layers."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        if self.static:
            other.cache = StaticCache(config=self.model.config, max_cache_len=self.capacity)
        other.own_cache()
        return other

    def own_cache(self) -> None:
        """Start an empty cache whose in-place layers are this object's own, as reserved so far
        (for a copy sharing another's model: it must not write into the other's storage)."""
        self.growing = {index: GrowingLayer(layer.capacity) for index, layer in self.growing.items()}
        if self.lean is not None:
            self.lean = self.lean.own_storage()
        self.reset()

    def reserve(self, max_len: int) -> None:
        """Size a static cache for sequences of up to max_len tokens, rounded up
        to a multiple of 256 so that runs with similar lengths share one compiled
        shape. The dynamic cache allocates room for max_len at its next sequence."""
        if self.lean is not None:
            self.lean.reserve(max_len)
            return
        if not self.static:
            for layer in self.growing.values():
                layer.reserve(max_len)
            return
        capacity = min(-(-max_len // 256) * 256, self.context)
        window = getattr(self.text_config, "sliding_window", None)
        if window and max_len <= window < capacity:  # sliding-window layers roll back only within their window
            capacity = window
        if capacity != self.capacity:
            self.capacity = capacity
            self.cache = StaticCache(config=self.model.config, max_cache_len=capacity)
            self.reset()
        self._check_static_rollback()

    def _check_static_rollback(self) -> None:
        if not self.cache.is_croppable:  # sliding-window layers shorter than the cache drop what a rollback restores
            window = getattr(self.text_config, "sliding_window", None)
            raise HarnessError(f"{type(self.model).__name__} has sliding-window attention (window {window}) and a static cache "
                               f"of {self.capacity} tokens cannot roll back past the window: use cache=dynamic")

    def warm_up(self, shapes: list[tuple[int, int]]) -> None:
        """Compile the steps a run will take now, outside any timing: each
        (input tokens, logits kept) pair after a one-token prompt. No-op when
        not compiled. With CUDA graphs each step is called twice: torch's graph
        trees run a function's first call as a warm-up and record its graph at
        the second, which would otherwise happen inside the first timed prompt."""
        if self.compiled is None:
            return
        ids = torch.zeros(1 + max(t for t, _ in shapes), dtype=torch.long, device=self.device)
        for _ in range(2 if self.graphs else 1):
            for tokens, num_logits in shapes:
                self.reset()
                self.forward(ids[:1])  # the prompt: eager, and it initialises the static cache
                self.forward(ids[1 : 1 + tokens], num_logits=num_logits)
        self.reset()

    @torch.inference_mode()
    def reset(self, rollback: bool = True) -> None:
        """Empty the cache: a new sequence starts. rollback=False: it will never be rolled back (the baseline)."""
        self.trims = False  # a dynamic cache to crop after every cycle, rejection or not
        if self.static:
            self.cache.reset()  # in place: the compiled steps keep their addresses
        elif self.lean is None:  # lean storage is simply overwritten from position 0 on
            self.cache = in_place(DynamicCache(config=self.model.config), self.growing)
            if rollback:
                # Sliding-window layers then keep what leaves the window until the next crop, which can
                # bring it back; from the first pass on, as the prompt's pass also verifies the first drafts.
                # Every cycle's rollback crops them back to the window (`trims`).
                self.cache.activate_past_recording()
                self.trims = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        self.length = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        """Append input_ids [T] to the cache; logits [num_logits, vocab] of the last positions."""
        if self.static and self.length + input_ids.shape[0] > self.capacity:
            raise HarnessError(f"the static KV cache holds {self.capacity} tokens and this sequence needs more: use cache=dynamic, or reserve a longer sequence")
        if self.static and not self.cache_checked:  # sliding-window layers shorter than the cache (reserve() says so too)
            self._check_static_rollback()  # before the forward: it depends on the cache alone, and leaves it as it was
        if self.readable < self.vocab_size:
            input_ids = torch.where(input_ids < self.readable, input_ids, 0)  # on the device: no host read
        if self.lean is not None:
            logits = self.lean(input_ids, self.length, num_logits)  # [num_logits, scored]
            self.length += input_ids.shape[0]
            return self._widen(logits[:, : self.vocab_size])
        step_not_prompt = self.length > 0 and input_ids.shape[0] <= self.COMPILED_MAX_TOKENS
        step = self.compiled if self.compiled is not None and step_not_prompt else self.model
        out = step(input_ids=input_ids.unsqueeze(0), **{self.cache_kwarg: self.cache}, use_cache=True, logits_to_keep=num_logits)
        if not self.cache_checked:  # once per model (until it passes): reading the cache's length is a host sync on CUDA
            if self.cache.get_seq_length() != input_ids.shape[0]:
                raise HarnessError(f"{type(self.model).__name__}.forward did not fill the KV cache passed as `{self.cache_kwarg}`: "
                                   "its forward must take the cache as `cache` or `past_key_values` and fill it (HF causal LMs do)")
            if not self.cache.is_croppable:
                raise HarnessError(f"{type(self.model).__name__} keeps a recurrent state in its cache (linear attention), which "
                                   "cannot be rolled back to drop rejected drafts: speculative decoding here needs an attention model")
            self.cache_checked = True
        self.length += input_ids.shape[0]
        logits = out.logits[0, -num_logits:, : self.vocab_size]
        if self.scored >= self.vocab_size and step is self.compiled and self.device.type == "cuda":
            return logits.clone()  # a CUDA graph's output is overwritten by its next replay
        return self._widen(logits)

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """[num_logits, vocab_size]: the rows a draft lacks get -inf (it can never draft them)."""
        if self.scored < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - self.scored), value=float("-inf"))
        return logits

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Cache input_ids [T] (T may be 0); the logits [vocab] after the last one, if any."""
        if input_ids.shape[0] > 0:
            return self.forward(input_ids, num_logits=1)[0]
        return None

    def can_roll_back(self, length: int) -> bool:
        """Whether a rollback to `length` finds what it restores. Sliding-window layers
        keep what left their window only until the next rollback: one cycle's worth."""
        removed = self.length - length
        if self.static or not self.trims or removed <= 0:
            return True
        return all(layer.keys.shape[-2] - removed >= min(self.length - removed, layer.sliding_window - 1)
                   for layer in self.cache.layers if getattr(layer, "is_sliding", False) and layer.is_initialized)

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """Drop cached positions at and beyond `length` (rejected tokens)."""
        if length < self.length and self.lean is not None:
            self.length = length  # attention reads the first `length` positions; later ones are overwritten
        elif length < self.length:
            if self.static:
                self._check_static_rollback()
            elif not self.can_roll_back(length):  # HF's sliding layer would cut the wrong positions, and attention fail
                raise HarnessError(f"{type(self.model).__name__}'s sliding-window layers no longer hold the positions a rollback "
                                   f"from {self.length} to {length} tokens restores: only what the last forward passes fed can be dropped")
            self.cache.crop(length - self.length)  # transformers 5: negative = tokens to remove; static: moves the position
            self.length = length
        elif self.trims and self.length > 0:  # an empty cache (a one-token prompt's draft) has no layer to trim
            self.cache.crop(0)  # nothing rejected: sliding-window layers drop what left the window


def _widths(model, vocab_size: int) -> tuple[int, int]:
    """(tokens the model scores, up to vocab_size; token ids it can read). A head with a vocab_size of its own
    (harness.models.shared_draft.SubsetHead) scores that many; a model without HF's embedding accessors, all."""
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return vocab_size, vocab_size
    scored = getattr(head, "vocab_size", None) or head.weight.shape[0]
    return min(vocab_size, scored), embedding.weight.shape[0]


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name under which the model's forward takes its KV cache: `cache` in recent
    transformers 5.x (5.24), `past_key_values` in earlier ones (5.17) and in classes not yet renamed.
    A wrong name is swallowed by **kwargs and the model silently runs without its past."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _compile(model: PreTrainedModel, mode: str | None):
    """torch.compile a model for fixed shapes (one graph per input length; CUDA graphs on GPU).
    Hooks registered on the model still run. Calls run `unwatched`: a host-read count
    (harness.core.host_syncs) active around them would make dynamo compile them anew."""
    # Input lengths 1..k+1 each compile once, for target and draft alike (one code object: transformers'
    # forward wrapper), and again for each cache capacity a process reserves (a multirun's cells): allow far
    # more than dynamo's default of 8, and make running out an error, not a silent fall back to eager.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name before torch 2.7
    setattr(config, limit, max(getattr(config, limit), 64 * CachedLM.COMPILED_MAX_TOKENS))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * getattr(config, limit))
    if hasattr(config, "fail_on_recompile_limit_hit") and not config.suppress_errors:  # torch refuses both at once
        config.fail_on_recompile_limit_hit = True
    return functools.partial(unwatched, torch.compile(model, mode=mode, dynamic=False))
