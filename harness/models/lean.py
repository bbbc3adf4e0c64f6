"""A lean forward for Llama-architecture models (`forward=lean`).

The same computation as HF's forward with fewer calls (docs/design.md, "The lean forward"): the q, k and
v projections are one product and so are gate and up (the model's own weights re-pointed as views of
one fused tensor per layer, so HF's modules keep working on the same memory); keys and values live in
one KVStore (harness.models.kv_store); one scaled_dot_product_attention call per layer. It is checked
against HF's logits when a model is wrapped (`check`): a model it would compute differently is refused
in one line. Only `LlamaForCausalLM` is taken; anything else needs `forward=hf`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.base.host_reads import from_host
from harness.errors import HarnessError
from harness.models.backend import Backend
from harness.models.captured import Captured, padded_rows, room, runs_captured
from harness.models.cpu_linear import planned_linear
from harness.models.kv_store import KVStore, Step, Tree, is_chain

# check(): the largest logit difference from HF's forward, over the largest logit, that passes
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
# bfloat16 / float16: on the CPU the lean forward gave HF's bits in both (SmolLM2, 5 prompts); HF's own
# forward moved by up to 1.4% (bf16) between a 24 + 3 token run and all 27 at once, the kind of difference
# a GPU's products of other shapes (the fused ones) may bring
TOLERANCE_16BIT = 5e-2


def unsupported(model: nn.Module) -> str | None:
    """Why the lean forward cannot run this model, or None."""
    name = type(model).__name__
    if name != "LlamaForCausalLM" or getattr(model.config, "model_type", None) != "llama":
        return f"{name} (model_type {getattr(model.config, 'model_type', '?')}) is not a LlamaForCausalLM"
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return f"{name} runs with accelerate hooks (device_map offloading), which the lean forward would bypass"
    if getattr(model.config, "pretraining_tp", 1) not in (None, 1):
        return f"{name} has pretraining_tp={model.config.pretraining_tp}"
    if type(model.model.embed_tokens) is not nn.Embedding:
        return f"{name}'s embedding is a {type(model.model.embed_tokens).__name__}, not an nn.Embedding"
    return None


def _fuse(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum N, K] (and bias) for several linear layers; each layer's own weight
    (and bias) becomes a view of it, so the memory is not doubled and the layers still work."""
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's LlamaRMSNorm, rounded where it rounds: normalised in float32, cast back, then scaled
    in the input's dtype. One fused call in float32, where this is the same; in bfloat16 a
    single rounding (F.rms_norm with the weight inside) moved SmolLM2's logits by up to 5.7%
    of the largest one from HF's, and this order gives HF's bits (docs/design.md)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF's Llama applies it: x [..., heads, T, D], cos and sin broadcasting to it ([..., 1, T, D] or [T, D])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanLlama:
    """The lean forward of one LlamaForCausalLM, with KV storage of its own for `rows` sequences
    (one by default; a batch's rows each have their own length: harness.models.batched)."""

    def __init__(self, model: nn.Module, rows: int = 1):
        if reason := unsupported(model):
            raise HarnessError(f"forward=lean runs Llama-architecture models only: {reason}; use forward=hf")
        self.model, self.inner = model, model.model
        config = model.config
        self.layers = list(self.inner.layers[: config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        fused = getattr(model, "_harness_lean_fused", None)  # once per model: every LeanLlama of it shares it
        if fused is None:
            fused = [
                (
                    _fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                    _fuse([layer.mlp.gate_proj, layer.mlp.up_proj]),
                )
                for layer in self.layers
            ]
            model._harness_lean_fused = fused
            model.fused_linear_weights = [weight for products in fused for weight, _ in products]  # for cpu_linear's plans
        self.fused = fused
        self.rows = rows
        self.captured: Captured | None = None  # compile=true: the steps after a prompt, compiled (`compile`)
        self.store = KVStore(len(self.layers), rows, self.kv_heads, self.head_dim, self.layers[0].self_attn.o_proj.weight)

    def like(self, rows: int) -> LeanLlama:
        """The same model's lean forward for `rows` rows, with storage of its own, compiled if this one is."""
        other = LeanLlama(self.model, rows)
        if self.captured is not None:
            other.compile()
        return other

    @property
    def capacity(self) -> int:
        return self.store.capacity

    def reserve(self, length: int) -> None:
        """Room for `length` positions per row (compiled: and a step's padding); what is stored is kept."""
        self.store.reserve(room(length, self.captured))

    def keep_rows(self, kept: list[int]) -> None:
        """Only the rows `kept` (indices, in order) go on: a batch drops the others."""
        self.store.keep_rows(kept)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        starts: list[int],
        num_logits: list[int],
        counts: list[int] | None = None,
        capture: tuple[int, ...] = (),
        tree: Tree | None = None,
    ):
        """Row b feeds input_ids[b] [T] at positions starts[b].. of its stored row (host ints), the first
        counts[b] of them real (default: all; the rest is padding, written past the row's length and never
        read); logits [N, V] of each row's last num_logits[b] real positions, row by row. capture (layer
        indices, L for the final normed state): also the hidden states [B, T, len(capture) * hidden].
        tree (one row): the parents of the last len(tree) slots (KVStore.step), run eagerly, never captured."""
        B, T = input_ids.shape
        self._count_pass()
        counts = counts or [T] * B
        tree = None if tree is None or is_chain(tree) else tree  # a chain is a plain step
        if tree is None and runs_captured(self.captured, starts, counts, T):
            x, taken = self._captured_step(input_ids, starts, capture)  # a step after the prompt: fixed shapes
        else:
            x, taken = self._layers(input_ids, self.store.step(starts, T, tree), capture)  # [B, T, hidden]
        if B == 1:  # one row: its last positions are a slice

            def chosen(h: torch.Tensor) -> torch.Tensor:
                return h[0, counts[0] - num_logits[0] : counts[0]]  # [n, hidden]

        else:
            pairs = [v for row, (c, n) in enumerate(zip(counts, num_logits)) for t in range(c - n, c) for v in (row, t)]
            index = from_host(pairs, input_ids.device).view(-1, 2)  # [N, 2] (row, position in its feed)

            def chosen(h: torch.Tensor) -> torch.Tensor:
                return h[index[:, 0], index[:, 1]]  # [N, hidden]

        last = len(self.layers)
        if last in capture:  # the final normed state at every position: the logits' rows are some of them
            taken[last] = _rms_norm(x, self.inner.norm)
            h = chosen(taken[last])
        else:
            h = _rms_norm(chosen(x), self.inner.norm)
        logits = self.model.lm_head(h)  # [N, V]
        return (logits, torch.cat([taken[i] for i in capture], dim=-1)) if capture else logits

    def compile(self) -> None:
        """compile=true: the steps after a prompt (every row fed past its position 0, at most
        COMPILED_MAX_TOKENS positions) run captured (harness.models.captured): over the storage's whole
        capacity and all its rows, one graph per (rows, positions, capacity)."""
        self.captured = Captured(self._fixed_layers, f"lean forward of {type(self.model).__name__}", self.store.like.device)

    def warm_up(self, widths, captures=((),)) -> None:
        """Compile the captured steps of these widths (returning each of `captures`' features) now,
        outside any timing; then refuse new shapes."""
        if self.captured is None:
            return
        with self.captured.warming():
            ids = torch.zeros(self.rows, max(widths), dtype=torch.long, device=self.store.like.device)
            for T in widths:
                for capture in captures:
                    self._captured_step(ids[:, :T], [1] * self.rows, tuple(capture))

    def _captured_step(self, input_ids, starts: list[int], capture) -> tuple[torch.Tensor, dict]:
        """_layers over every row of the storage at its whole capacity (finished rows: padding at position 0)."""
        B, T = input_ids.shape
        positions = self.store.fixed_positions(starts, T)  # [rows, T]
        x, taken = self.captured((self.rows, T, self.capacity, capture), padded_rows(input_ids, self.rows), positions, capture)
        return (x[:B], {i: t[:B] for i, t in taken.items()}) if B < self.rows else (x, taken)

    def _fixed_layers(self, input_ids, positions, capture):
        return self._layers(input_ids, self.store.fixed_step(positions), capture)

    def _count_pass(self) -> None:
        for key, hook in self.model._forward_pre_hooks.items():  # a pass of the model to whoever counts them (the bench)
            hook(self.model, (), {}) if key in self.model._forward_pre_hooks_with_kwargs else hook(self.model, ())

    def _layers(self, input_ids, step: Step, capture) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers over input_ids [B, T] at the step's positions, each layer's new keys and values
        written to the store. Hidden states [B, T, hidden] after the last layer, and the inputs of the layers in `capture`."""
        B, T = input_ids.shape
        x = self.inner.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = self.inner.rotary_emb(x, step.positions)  # [B, T, D] each
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
        split = (self.heads, self.kv_heads, self.kv_heads)
        plans = getattr(self.model, "fused_linear_plans", None) or [None] * 2 * len(self.layers)  # [qkv, gate/up] a layer
        taken: dict[int, torch.Tensor] = {}  # layer index -> its input [B, T, hidden]
        for index, (layer, ((qkv_w, qkv_b), (gu_w, gu_b))) in enumerate(zip(self.layers, self.fused)):
            if index in capture:
                taken[index] = x
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, layer.input_layernorm)
            qkv = planned_linear(h, qkv_w, qkv_b, plans[2 * index])  # [B, T, (heads + 2 kv_heads) D]
            q, k, v = qkv.view(B, T, -1, self.head_dim).transpose(1, 2).split(split, dim=1)  # [B, heads|kv_heads, T, D]
            read_keys, read_values = self.store.write(index, rotate(k, cos, sin), v, step)
            out = F.scaled_dot_product_attention(
                rotate(q, cos, sin), read_keys, read_values, attn_mask=step.mask, scale=self.scaling, enable_gqa=True
            )  # [B, heads, T, D]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
            h = _rms_norm(x, layer.post_attention_layernorm)
            gate, up = planned_linear(h, gu_w, gu_b, plans[2 * index + 1]).chunk(2, dim=-1)  # [B, T, intermediate] each
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        return x, taken


@torch.inference_mode()
def check(lean: LeanLlama, cache_kwarg: str) -> None:
    """Refuse a model whose logits the lean forward does not reproduce: a prompt of 24 tokens,
    then a step of 3, through HF's forward and the lean one (ids from a fixed generator: the
    global random state is not touched)."""
    from transformers import DynamicCache

    model = lean.model
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (27,), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache(config=model.config)
    theirs = [
        model(input_ids=ids[None, :24], **{cache_kwarg: cache}, use_cache=True).logits[0],
        model(input_ids=ids[None, 24:], **{cache_kwarg: cache}, use_cache=True).logits[0],
    ]
    ours = [lean.forward(ids[None, :24], [0], [24]), lean.forward(ids[None, 24:], [24], [3])]
    scale = max(t[t.isfinite()].abs().max().item() for t in theirs)
    worst = max(((a - b).nan_to_num(0.0, 0.0, 0.0).abs().max().item() for a, b in zip(theirs, ours)), default=0.0)
    same_infinite = all(torch.equal(a.isfinite(), b.isfinite()) for a, b in zip(theirs, ours))
    tolerance = TOLERANCE.get(lean.model.dtype, TOLERANCE_16BIT)
    if not same_infinite or not worst <= tolerance * max(scale, 1.0):
        raise HarnessError(
            f"forward=lean does not reproduce {type(model).__name__}'s logits (largest difference {worst:.3g} "
            f"against logits up to {scale:.3g}; allowed {tolerance:g} of that): use forward=hf"
        )


class LeanBackend(Backend):
    """The lean forward as a CachedLM backend. A rollback only moves `length`: attention reads the
    first `length` positions, and later ones are overwritten by the next forward."""

    def __init__(self, lean: LeanLlama, capacity: int):
        self.lean, self.capacity, self.length = lean, capacity, 0

    @classmethod
    def checked(
        cls, model: nn.Module, cache_kwarg: str, max_len: int | None, capacity: int, compile: bool = False
    ) -> LeanBackend:
        """The lean forward of this model (its steps compiled with compile=True), refused (HarnessError) if its logits are not HF's."""
        lean = LeanLlama(model)
        check(lean, cache_kwarg)
        lean.reserve(max_len or 1)
        if compile:
            lean.compile()
        return cls(lean, capacity)

    def forward(self, input_ids: torch.Tensor, num_logits: int, tree: Tree | None = None) -> torch.Tensor:
        logits = self.lean.forward(input_ids[None], [self.length], [num_logits], tree=tree)  # [num_logits, V]
        self.length += input_ids.shape[0]
        return logits

    def forward_features(self, input_ids, num_logits, layers, tree=None):
        logits, features = self.lean.forward(input_ids[None], [self.length], [num_logits], capture=layers, tree=tree)
        self.length += input_ids.shape[0]
        return logits, features[0]  # [n, V], [T, F]

    def compact(self, base: int, kept: list[int]) -> None:
        self.lean.store.compact(0, base, kept)

    def reset(self, rollback: bool = True) -> None:
        self.length = 0  # the storage is simply overwritten from position 0 on

    def reserve(self, max_len: int) -> None:
        self.lean.reserve(max_len)

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)

    def copy(self, share_static_cache: bool = False) -> LeanBackend:
        """share_static_cache=True (a copy used in turns with this one, never interleaved: the bench's timed
        copies): the same storage and compiled steps; otherwise storage of its own."""
        if share_static_cache:
            return LeanBackend(self.lean, self.capacity)
        lean = self.lean.like(1)  # the model's fused weights, storage of its own, as large
        lean.store.reserve(self.lean.capacity)
        return LeanBackend(lean, self.capacity)
