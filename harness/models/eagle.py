"""Feature heads: drafts that read the target's hidden states (EAGLE-style), in the layouts their authors publish.

A head is one decoder layer beside the target: at pair position i it reads the target's feature f_i and the
embedding of t_{i+1}, and predicts the next feature, whose logits score t_{i+2}; past the committed tokens it
reads its own output instead. `eagle` (EAGLE-1): f_i is the final normed state, scored by the target's LM
head. `eagle3` (EAGLE-3): f_i is the inputs of target layers 2, L/2 and L-3, and its own `lm_head` scores a
draft vocabulary (token j: target token j + d2t[j]). Layouts and checkpoints: docs/models.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from harness.base.host_reads import from_host
from harness.errors import HarnessError
from harness.models.captured import Captured, padded_rows, room, runs_captured
from harness.models.kv_store import KVStore, Step
from harness.models.lean import rotate

LAYOUTS = ("eagle", "eagle3")
LAYER_PREFIX = {"eagle": "layers.0.", "eagle3": "midlayer."}  # where a layout's checkpoint keeps its decoder layer
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 head reads: an early, a middle and a late one."""
    return 2, num_layers // 2, num_layers - 3


class RMSNorm(nn.Module):
    """Llama's RMS norm: normalised in float32, cast back, then scaled (as HF's LlamaRMSNorm rounds)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, inputs: int):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(inputs, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(inputs, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(inputs, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """The head's decoder layer: EAGLE-1's without an input norm, or EAGLE-3's midlayer (two input norms)."""

    def __init__(self, config: LlamaConfig, layout: str):
        super().__init__()
        H = config.hidden_size
        self.self_attn = Attention(config, 2 * H if layout == "eagle3" else H)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        if layout == "eagle3":
            self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, config.rms_norm_eps)


class FeatureHead(nn.Module):
    """A feature head in one of LAYOUTS, with the target's embedding (and, for eagle, LM head) beside it.
    `reads`: the target layers it reads (CachedLM.forward_features: index L is the final normed state)."""

    def __init__(self, layout: str, config: LlamaConfig, target: nn.Module, target_hidden: int, fc_bias: bool = False):
        super().__init__()
        H, layers = config.hidden_size, target.config.get_text_config(decoder=True).num_hidden_layers
        self.layout, self.config = layout, config
        self.fc = nn.Linear(3 * target_hidden if layout == "eagle3" else 2 * H, H, bias=fc_bias)
        layer = Layer(config, layout)
        if layout == "eagle3":
            self.midlayer = layer
            self.norm = RMSNorm(H, config.rms_norm_eps)
            self.draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
            self.lm_head = nn.Linear(H, self.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
            self.reads = eagle3_layers(layers)
        else:
            self.layers = nn.ModuleList([layer])
            self.reads = (layers,)
        self.rotary = LlamaRotaryEmbedding(config=config)
        # The target's modules, read but not owned (not registered: neither trained nor counted as the head's).
        self.shared = {"embed": target.get_input_embeddings(), "lm_head": target.get_output_embeddings()}
        self.target_vocab = self.shared["embed"].weight.shape[0]
        self.to_target: torch.Tensor | None = None  # eagle3: draft token j -> target token j + d2t[j]

    @property
    def layer(self) -> Layer:
        return self.midlayer if self.layout == "eagle3" else self.layers[0]

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's three features [..., 3H_t] into the head's space [..., H]."""
        return self.fc(hidden)

    def attention_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what attention reads [..., T, H or 2H], the residual [..., T, H]) for tokens [..., T] after features hidden [..., T, H]."""
        embedded = self.shared["embed"](tokens)  # [T, H]
        if self.layout == "eagle3":
            layer = self.midlayer
            return torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(hidden)], dim=-1), hidden
        x = self.fc(torch.cat([embedded, hidden], dim=-1))  # [T, H]
        return x, x  # EAGLE-1's first layer has no input norm

    def qkv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [..., heads, T, D], keys and values [..., kv_heads, T, D] for inputs h [..., T, *] at
        positions [..., T] (one sequence, or a batch's rows)."""
        attn, lead, T = self.layer.self_attn, h.shape[:-2], h.shape[-2]
        cos, sin = self.rotary(h.reshape(-1, T, h.shape[-1]), positions.reshape(-1, T))  # [rows, T, D] each
        cos, sin = cos.reshape(*lead, 1, T, -1), sin.reshape(*lead, 1, T, -1)

        def heads(proj: nn.Linear, count: int) -> torch.Tensor:
            return proj(h).view(*lead, T, count, attn.head_dim).transpose(-3, -2)

        q, k, v = heads(attn.q_proj, attn.heads), heads(attn.k_proj, attn.kv_heads), heads(attn.v_proj, attn.kv_heads)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output [..., T, H] from its residual [..., T, H] and attention output [..., heads, T, D]."""
        layer = self.layer
        x = residual + layer.self_attn.o_proj(attended.transpose(-3, -2).reshape(*residual.shape[:-1], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits [n, target vocab] for outputs out [n, H]; eagle3's tokens outside its vocabulary: -inf."""
        if self.layout == "eagle":
            return self.shared["lm_head"](out)
        draft = self.lm_head(self.norm(out))  # [n, draft vocab]
        full = draft.new_full((out.shape[0], self.target_vocab), float("-inf"))
        full[:, self.to_target_ids()] = draft
        return full

    def to_target_ids(self) -> torch.Tensor:
        """eagle3: the target token of each draft token [draft vocab] (j + d2t[j]); computed once, after loading."""
        if self.to_target is None or self.training:
            self.to_target = torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t
        return self.to_target


class HeadRows:
    """A feature head over a batch's rows: KV storage of its own (harness.models.kv_store.KVStore), each
    row at its own length (`lengths`, host ints: a rollback only moves them). The head's weights are shared."""

    def __init__(self, head: FeatureHead, rows: int, capacity: int = 0, compile: bool = False):
        self.head, self.rows = head, rows
        self.lengths = [0] * rows
        attn = head.layer.self_attn
        self.store = KVStore(1, rows, attn.kv_heads, attn.head_dim, attn.o_proj.weight)
        self.store.reserve(max(capacity, 1))
        if head.layout == "eagle3":
            head.to_target_ids()  # made once, before any step is compiled
        # compile=true: steps after the first captured (harness.models.captured.runs_captured)
        self.captured = Captured(self._fixed, f"{head.layout} head", attn.o_proj.weight.device) if compile else None

    def warm_up(self, widths: list[int]) -> None:
        """Compile the captured steps now: widths pairs read from the target, one pair of the head's own."""
        if self.captured is None:
            return
        like, head = self.store.like, self.head
        with self.captured.warming():
            for T, from_target in [(T, True) for T in widths] + [(1, False)]:
                width = head.fc.in_features if from_target and head.layout == "eagle3" else head.config.hidden_size  # F
                tokens = torch.zeros(self.rows, T, dtype=torch.long, device=like.device)
                self._captured(tokens, like.new_zeros(self.rows, T, width), [1] * self.rows, [T] * self.rows, from_target)

    def reserve(self, length: int) -> None:
        self.store.reserve(room(length, self.captured))

    def keep_rows(self, kept: list[int]) -> None:
        """Only the rows `kept` (in order) go on: their storage moves up."""
        self.store.keep_rows(list(kept))
        self.lengths = [self.lengths[i] for i in kept]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, counts: list[int], from_target: bool, tree=None):
        """Row i's pairs at positions lengths[i].. : tokens [B, T] after features hidden [B, T, F] (the target's
        when from_target, else the head's outputs [B, T, H]), the first counts[i] real (the rest padding).
        (logits [B, V] of each row's last real pair, outputs [B, T, H]). tree (one row: the parents of its
        last slots, harness.models.kv_store.tree_layout): the pairs are tree nodes, and the logits [T, V] every pair's."""
        B, T = tokens.shape
        starts, self.lengths = self.lengths, [n + c for n, c in zip(self.lengths, counts)]
        if tree is not None:
            return self._pairs(tokens, hidden, self.store.step(starts, T, tree), slice(0, T), from_target)
        if runs_captured(self.captured, starts, counts, T):
            return self._captured(tokens, hidden, starts, counts, from_target)
        step = self.store.step(starts, T)
        if B == 1:
            return self._pairs(tokens, hidden, step, slice(max(counts[0], 1) - 1, max(counts[0], 1)), from_target)
        last = from_host([max(c, 1) - 1 for c in counts], tokens.device)  # [B]
        return self._pairs(tokens, hidden, step, (torch.arange(B, device=tokens.device), last), from_target)

    def _pairs(self, tokens, hidden, step: Step, last, from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's layer over the step's pairs: the logits [B, V] at out[last] (one position per row), outputs [B, T, H]."""
        head = self.head
        if from_target and head.layout == "eagle3":
            hidden = head.fuse(hidden)
        h, residual = head.attention_input(tokens, hidden)
        q, k, v = head.qkv(h, step.positions)  # [B, heads, T, D], [B, kv_heads, T, D] x 2
        keys, values = self.store.write(0, k, v, step)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask, enable_gqa=True)  # [B, heads, T, D]
        out = head.finish(residual, attended)  # [B, T, H]
        picked = out[:, last] if isinstance(last, slice) else out[last]
        return head.logits(picked.reshape(-1, out.shape[-1])), out

    def _captured(self, tokens, hidden, starts, counts, from_target):
        """step() over every row of the storage at its whole capacity (finished rows: padding at position 0)."""
        (B, T), rows = tokens.shape, self.rows
        positions = self.store.fixed_positions(starts, T)  # [rows, T]
        last = from_host([max(c, 1) - 1 for c in counts] + [0] * (rows - B), tokens.device)  # [rows]
        key = (rows, T, self.store.capacity, from_target)
        logits, out = self.captured(key, padded_rows(tokens, rows), padded_rows(hidden, rows), positions, last, from_target)
        return (logits[:B], out[:B]) if B < rows else (logits, out)

    def _fixed(self, tokens, hidden, positions, last, from_target):
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return self._pairs(tokens, hidden, self.store.fixed_step(positions), (rows, last), from_target)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.exists():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                state = load_file(path)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
            # Older checkpoints carry RoPE's inverse frequencies (a buffer recomputed from the config).
            return {key.removeprefix("model."): value for key, value in state.items() if not key.endswith("rotary_emb.inv_freq")}
    raise HarnessError(f"feature head folder {folder} holds none of {', '.join(WEIGHT_FILES)}: not a head checkpoint")


def head_folder(head_id: str, revision: str | None = None) -> Path:
    """The local folder of a head: an embedded one, a path, or a hub id (downloaded, or from the HF cache offline)."""
    if head_id.startswith("embedded:"):
        from harness.models.embedded import embedded_model_dir

        return embedded_model_dir(head_id.removeprefix("embedded:"))
    path = Path(head_id).expanduser()
    if path.exists():
        return path
    if head_id.startswith((".", "/", "~")) or head_id.count("/") > 1:
        raise HarnessError(f"feature head path '{head_id}' does not exist: fix pair.draft.id")
    from huggingface_hub import snapshot_download

    from harness.base.hub import hub_reachable

    files = ["config.json", *WEIGHT_FILES]
    try:
        return Path(snapshot_download(head_id, revision=revision, allow_patterns=files, local_files_only=not hub_reachable()))
    except Exception as err:  # huggingface_hub's errors for a missing, gated or uncached repo
        reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise HarnessError(
            f"feature head '{head_id}' could not be fetched ({reason}): download it where the hub is reachable "
            f"(hf download {head_id}) or give a local folder (pair.draft.id=/path/to/head)"
        ) from err


def load_head(head_id: str, layout: str, target: nn.Module, dtype: torch.dtype, revision: str | None = None) -> FeatureHead:
    """A feature head for `target` in `layout`, checked against it; any mismatch is one line."""
    if layout not in LAYOUTS:
        raise HarnessError(f"pair.draft.kind={layout} is not a feature head layout: use {' or '.join(LAYOUTS)}")
    folder = head_folder(head_id, revision)
    if not (folder / "config.json").exists():
        raise HarnessError(f"feature head '{head_id}' has no config.json in {folder}: not a head checkpoint")
    try:
        config = LlamaConfig(**json.loads((folder / "config.json").read_text()))
        state = _weights(folder)
    except HarnessError:
        raise
    except Exception as err:  # a damaged file raises whatever its reader raises (SafetensorError, JSONDecodeError...)
        from harness.models.integrity import unreadable_head

        if (found := unreadable_head(folder, WEIGHT_FILES)) is None:
            raise
        other = ", or point pair.draft.id at a complete head folder"
        if head_id.startswith("embedded:"):
            fix = "the harness's installation is damaged: reinstall it"
        elif Path(head_id).expanduser().exists():
            fix = f"download or save the head into {folder} again (an interrupted download leaves files cut short or missing){other}"
        else:
            fix = f"delete that cache entry (hf cache rm model/{head_id}) and download it again (hf download {head_id}){other}"
        raise HarnessError(f"feature head '{head_id}' cannot be read: {found[0]} {found[1]}: {fix}") from err
    target_config = target.config.get_text_config(decoder=True)
    target_hidden = int(getattr(config, "target_hidden_size", None) or target_config.hidden_size)
    target_vocab = target.get_input_embeddings().weight.shape[0]
    problem = _mismatch(layout, config, state, target_config, target_hidden, target_vocab)
    if problem:
        raise HarnessError(f"feature head '{head_id}' does not fit target {type(target).__name__}: {problem}")
    head = FeatureHead(layout, config, target, target_hidden, fc_bias="fc.bias" in state)
    embedded = state.pop("embed_tokens.weight", None)  # EAGLE-1 checkpoints may carry the target's table: the target's is used
    if embedded is not None and embedded.shape[0] != target_vocab:
        raise HarnessError(
            f"feature head '{head_id}' does not fit target {type(target).__name__}: its embedding has "
            f"{embedded.shape[0]} rows, the target's {target_vocab}"
        )
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [key for key in missing if not key.startswith("rotary.")]
    if missing or unexpected:
        what = f"missing {', '.join(missing[:4])}" if missing else f"unexpected {', '.join(unexpected[:4])}"
        raise HarnessError(f"feature head '{head_id}' is not in the {layout} layout: {what}")
    device = next(target.parameters()).device
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _mismatch(layout, config, state, target_config, target_hidden: int, target_vocab: int) -> str | None:
    """Why a checkpoint cannot serve as a `layout` head of this target, or None."""
    prefix = LAYER_PREFIX[layout]
    needed = ["fc.weight", f"{prefix}self_attn.q_proj.weight", f"{prefix}mlp.down_proj.weight"]
    needed += ["norm.weight", "lm_head.weight", "d2t"] if layout == "eagle3" else []
    if absent := [key for key in needed if key not in state]:
        other = "eagle" if layout == "eagle3" else "eagle3"
        looks_like_other = any(key.startswith(LAYER_PREFIX[other]) for key in state)
        hint = f" (it looks like an {other} head: pair.draft.kind={other})" if looks_like_other else ""
        return f"missing {', '.join(absent)} for the {layout} layout{hint}"
    if getattr(config, "num_hidden_layers", 1) != 1:
        return f"it has {config.num_hidden_layers} decoder layers; the {layout} layout has one"
    if layout == "eagle" and config.hidden_size != target_config.hidden_size:
        return f"hidden size {config.hidden_size}, the target's {target_config.hidden_size}"
    fc_in = state["fc.weight"].shape[1]
    expected = 3 * target_hidden if layout == "eagle3" else 2 * config.hidden_size
    if fc_in != expected or target_hidden != target_config.hidden_size:
        return (
            f"its fc reads {fc_in} features, the target gives {expected if layout == 'eagle' else 3 * target_config.hidden_size}"
        )
    if config.vocab_size != target_vocab:
        return f"vocabulary of {config.vocab_size} tokens, the target's {target_vocab}"
    if layout == "eagle3":
        d2t = state["d2t"]
        if d2t.shape[0] != state["lm_head.weight"].shape[0] or int((torch.arange(d2t.shape[0]) + d2t).max()) >= target_vocab:
            return "its d2t map does not match its lm_head or points outside the target's vocabulary"
    return None
