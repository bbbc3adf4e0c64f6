"""Backends that run a model's own HF modules over a transformers cache (harness.models.backend).

`DynamicBackend`: HF's DynamicCache, its full-attention layers written in place (harness.models.kv_cache);
a rollback moves their length. `StaticBackend`: HF's StaticCache of `capacity` slots (sized by `reserve`:
attention reads every slot), a rollback moving the length back as gpt-fast does. Compiled steps (static
cache) run the forwards after a prompt, of at most COMPILED_MAX_TOKENS tokens; prompts run eagerly.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicLayer

from harness.base.host_reads import unwatched
from harness.config.settings import COMPILED_MAX_TOKENS
from harness.errors import HarnessError
from harness.models.backend import Backend
from harness.models.captured import allow_recompiles
from harness.models.kv_cache import GrowingLayer, in_place
from harness.models.kv_store import Tree, compaction, is_chain, tree_layout


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name under which the model's forward takes its KV cache: `cache` (transformers 5.24) or `past_key_values`
    (earlier, or classes not yet renamed). A wrong name is swallowed by **kwargs: the model runs without its past."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def compile_steps(model: PreTrainedModel, mode: str | None):
    """torch.compile a model for fixed shapes (CUDA graphs on GPU), called `unwatched` (a HostReads around them
    would make dynamo compile anew)."""
    allow_recompiles()
    return functools.partial(unwatched, torch.compile(model, mode=mode, dynamic=False))


def hf_backend(model: PreTrainedModel, kwarg: str, static: bool, capacity: int, context: int, compile: bool) -> HFBackend:
    """The backend for HF's forward: a static cache of `capacity` slots or a dynamic one, steps compiled or not."""
    backend = StaticBackend(model, kwarg, capacity, context) if static else DynamicBackend(model, kwarg, capacity)
    if compile and static and any(backend.cache.is_sliding):
        raise HarnessError(
            f"{type(model).__name__} has sliding-window layers, whose static cache (transformers' "
            f"StaticSlidingWindowLayer) compiles a new graph at every length: use compile=false"
        )
    backend.graphs = compile and backend.device.type == "cuda"  # CUDA graphs (mode="reduce-overhead"): see CachedLM.warm_up
    backend.compiled = compile_steps(model, "reduce-overhead" if backend.graphs else None) if compile else None
    return backend


class HFBackend(Backend):
    """HF's forward on a transformers cache (`self.cache`, which the subclasses make)."""

    def __init__(self, model: PreTrainedModel, kwarg: str, capacity: int):
        self.model, self.cache_kwarg, self.capacity = model, kwarg, capacity
        self.device = next(model.parameters()).device
        self.cache_checked = False  # the first prompt checks that the model really filled the cache
        self.length = 0

    def forward(self, input_ids: torch.Tensor, num_logits: int, tree: Tree | None = None) -> torch.Tensor:
        return self._step(input_ids, num_logits, tree=tree)[0]

    def forward_features(self, input_ids, num_logits, layers, tree=None):
        """The hidden states come back from the forward itself (output_hidden_states), compiled or not."""
        logits, states = self._step(input_ids, num_logits, hidden=True, tree=tree)
        return logits, torch.cat([states[i][0] for i in layers], dim=-1)  # [T, len(layers) * hidden]

    def _step(self, input_ids: torch.Tensor, num_logits: int, hidden: bool = False, tree: Tree | None = None):
        if tree is not None and not is_chain(tree):  # (a chain is a plain step)
            step, options = self.model, self._tree_inputs(tree, input_ids.shape[0])  # the eager model
        else:
            step_not_prompt = self.length > 0 and input_ids.shape[0] <= COMPILED_MAX_TOKENS
            step, options = self.compiled if self.compiled is not None and step_not_prompt else self.model, {}
        options[self.cache_kwarg] = self.cache
        out = step(input_ids=input_ids[None], **options, use_cache=True, logits_to_keep=num_logits, output_hidden_states=hidden)
        if not self.cache_checked:  # once per model (until it passes): reading the cache's length is a host sync on CUDA
            if self.cache.get_seq_length() != input_ids.shape[0]:
                raise HarnessError(
                    f"{type(self.model).__name__}.forward did not fill the KV cache passed as `{self.cache_kwarg}`: "
                    "its forward must take the cache as `cache` or `past_key_values` and fill it (HF causal LMs do)"
                )
            if not self.cache.is_croppable:
                raise HarnessError(
                    f"{type(self.model).__name__} keeps a recurrent state in its cache (linear attention), which "
                    "cannot be rolled back to drop rejected drafts: speculative decoding here needs an attention model"
                )
            self.cache_checked = True
        self.length += input_ids.shape[0]
        self.output_reused = step is self.compiled and self.device.type == "cuda"  # a CUDA graph's output buffer
        return out.logits[0, -num_logits:], out.hidden_states  # [num_logits, V], (L + 1) x [1, T, hidden] or None

    def _tree_inputs(self, tree: list[int], width: int) -> dict[str, torch.Tensor]:
        """position_ids [1, T] and the 4D attention mask [1, 1, T, end] of a tree step (tree_layout). transformers
        takes a 4D mask as given (masking_utils' `_preprocess_mask_arguments` returns it, unchecked), so it is made
        in the form the attention uses: boolean for sdpa (True: attended), additive for eager (0, or the dtype's
        least value), as masking_utils' sdpa_mask and eager_mask make theirs."""
        self._check_trees()
        attention = self.model.config._attn_implementation
        if attention not in ("sdpa", "eager"):
            raise HarnessError(
                f"token trees pass their own attention mask, which attn_implementation={attention} does not take: "
                "load the model with attn_implementation='sdpa' (or 'eager'), or feed a chain (drop `tree`)"
            )
        positions, mask = tree_layout(tree, self.length, width, self.device)  # [T], [T, end]
        mask = mask[None, None]  # [1, 1, T, end]
        if attention == "eager":
            dtype = self.model.dtype
            mask = torch.where(mask, torch.zeros((), dtype=dtype, device=self.device), torch.finfo(dtype).min)
        return {"position_ids": positions[None], "attention_mask": mask}

    def _check_trees(self) -> None:
        """Refuse token trees on a cache with layers that cannot be compacted (HarnessError)."""
        for layer in self.cache.layers:
            if type(layer) not in (GrowingLayer, DynamicLayer):
                raise HarnessError(
                    f"{type(self.model).__name__}'s cache has {type(layer).__name__} layers (sliding-window or "
                    "otherwise not plain full attention), which token trees cannot compact: feed a chain (drop `tree`)"
                )

    def compact(self, base: int, kept: list[int]) -> None:
        """Move slots base + kept[j] to base + j in every layer (all full attention: `_check_trees`)."""
        self._check_trees()
        if moves := compaction(base, kept, self.device):
            target, source = moves
            for layer in self.cache.layers:
                if layer.is_initialized:  # keys, values [B, H, length, D]: GrowingLayer's views of its storage
                    for stored in (layer.keys, layer.values):
                        stored[:, :, target] = stored.index_select(2, source)


class DynamicBackend(HFBackend):
    """HF's DynamicCache with in-place full-attention layers, kept across sequences (`growing`)."""

    def __init__(self, model: PreTrainedModel, kwarg: str, capacity: int):
        super().__init__(model, kwarg, capacity)
        self.growing: dict[int, GrowingLayer] = {}  # layer index -> its in-place layer
        self.reset()

    def reset(self, rollback: bool = True) -> None:
        self.cache = in_place(DynamicCache(config=self.model.config), self.growing)
        self.trims = False  # a cache to crop after every cycle, rejection or not
        if rollback:
            # Sliding-window layers keep what leaves the window until the next crop, which may bring it back;
            # every cycle's rollback crops them back to the window (`trims`).
            self.cache.activate_past_recording()
            self.trims = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        self.length = 0

    def reserve(self, max_len: int) -> None:
        """The in-place layers allocate room for max_len positions at their next sequence."""
        for layer in self.growing.values():
            layer.reserve(max_len)

    def can_roll_back(self, length: int) -> bool:
        """Sliding-window layers keep what left their window only until the next rollback: one cycle's worth."""
        removed = self.length - length
        if not self.trims or removed <= 0:
            return True
        return all(
            layer.keys.shape[-2] - removed >= min(self.length - removed, layer.sliding_window - 1)
            for layer in self.cache.layers
            if getattr(layer, "is_sliding", False) and layer.is_initialized
        )

    def rollback(self, length: int) -> None:
        if length < self.length:
            if not self.can_roll_back(length):  # HF's sliding layer would cut the wrong positions, and attention fail
                raise HarnessError(
                    f"{type(self.model).__name__}'s sliding-window layers no longer hold the positions a rollback "
                    f"from {self.length} to {length} tokens restores: only what the last forward passes fed can be dropped"
                )
            self.cache.crop(length - self.length)  # transformers 5: negative = tokens to remove
            self.length = length
        elif self.trims and self.length > 0:  # an empty cache (a one-token prompt's draft) has no layer to trim
            self.cache.crop(0)  # nothing rejected: sliding-window layers drop what left the window

    def copy(self, share_static_cache: bool = False) -> DynamicBackend:
        other = copy.copy(self)  # the model, compiled steps and checks shared
        other.growing = {index: GrowingLayer(layer.capacity) for index, layer in self.growing.items()}  # as reserved so far
        other.reset()
        return other


class StaticBackend(HFBackend):
    """HF's StaticCache of `capacity` slots; `reserve` resizes it."""

    def __init__(self, model: PreTrainedModel, kwarg: str, capacity: int, context: int):
        super().__init__(model, kwarg, capacity)
        self.context = context
        self.text_config = model.config.get_text_config(decoder=True)
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)  # `reserve` sizes it for a run

    def reset(self, rollback: bool = True) -> None:
        self.cache.reset()  # in place: the compiled steps keep their addresses
        self.length = 0

    def reserve(self, max_len: int) -> None:
        """Slots for sequences of up to max_len tokens, rounded up to 256 (similar lengths share a compiled shape)."""
        capacity = min(-(-max_len // 256) * 256, self.context)
        window = getattr(self.text_config, "sliding_window", None)
        if window and max_len <= window < capacity:  # sliding-window layers roll back only within their window
            capacity = window
        if capacity != self.capacity:
            self.capacity = capacity
            self.cache = StaticCache(config=self.model.config, max_cache_len=capacity)
            self.length = 0
        self.check_rollback()

    def check_rollback(self) -> None:
        """Refuse a cache whose sliding-window layers, shorter than the cache, drop what a rollback restores."""
        if not self.cache.is_croppable:
            window = getattr(self.text_config, "sliding_window", None)
            raise HarnessError(
                f"{type(self.model).__name__} has sliding-window attention (window {window}) and a static cache "
                f"of {self.capacity} tokens cannot roll back past the window: use cache=dynamic"
            )

    def forward(self, input_ids: torch.Tensor, num_logits: int, tree: Tree | None = None) -> torch.Tensor:
        if tree is not None:
            self._check_trees()
        if self.length + input_ids.shape[0] > self.capacity:
            raise HarnessError(
                f"the static KV cache holds {self.capacity} tokens and this sequence needs more: use cache=dynamic, or reserve a longer sequence"
            )
        if not self.cache_checked:  # before the forward: it depends on the cache alone, and leaves it as it was
            self.check_rollback()
        return super().forward(input_ids, num_logits)

    def forward_features(self, input_ids, num_logits, layers, tree=None):
        if tree is not None:
            self._check_trees()
        return super().forward_features(input_ids, num_logits, layers)

    def _check_trees(self) -> None:
        raise HarnessError(
            "token trees run on cache=dynamic (a static cache is not compacted): use cache=dynamic, or feed chains"
        )

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.check_rollback()
            self.cache.crop(length - self.length)  # moves the position; the stale slots are masked, then overwritten
            self.length = length

    def copy(self, share_static_cache: bool = False) -> StaticBackend:
        other = copy.copy(self)  # the model, compiled steps and checks shared
        if not share_static_cache:  # shared: the compiled steps (CUDA graphs) are bound to its tensors
            other.cache = StaticCache(config=self.model.config, max_cache_len=self.capacity)
        other.length = 0
        return other
