"""Drafts that share their target's embeddings and LM head.

On a small draft the LM head dominates a step's cost, so a shared-weights draft is a few layers on the
target's embedding table with a head over the S most frequent tokens: q is zero (or -cap after a logit
softcap) outside them, which the rule handles exactly. On disk, only what is not shared, in one folder:
harness_draft.json (format, head size, provenance), config.json (the draft's config) and
weights.safetensors (the layers, final norm and `head_token_ids` [S]).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from harness.errors import HarnessError
from harness.models import cpu_linear


class SubsetHead(nn.Module):
    """LM head over a subset of the vocabulary; other tokens get logit -inf."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.register_buffer("token_ids", token_ids, persistent=False)  # [S]
        self.weight = nn.Parameter(weight[token_ids].clone(), requires_grad=weight.requires_grad)  # [S, H]
        self.vocab_size = vocab_size
        self.rows_to: tuple[int, ...] | None = None  # harness.models.cpu_linear's plan where W @ x.T is the faster product

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, V]
        w, rows_to = self.weight, self.rows_to  # [S, H]
        subset_logits = cpu_linear.transposed_linear(hidden, w, None, rows_to) if rows_to else hidden @ w.T  # [B, T, S]
        logits = subset_logits.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.token_ids] = subset_logits
        return logits


def build_shared_draft(
    target: PreTrainedModel,
    num_layers: int,
    head_token_ids: torch.Tensor,
    init_layers: list[int] | None = None,
    layer_types: list[str] | None = None,
):
    """A new draft: `num_layers` layers copied from `init_layers` of the target (their attention types too,
    unless `layer_types` says), the target's embedding table (shared) and a subset head."""
    init_layers = init_layers if init_layers is not None else list(range(num_layers))
    settings = {**target.config.to_dict(), "num_hidden_layers": num_layers}
    types = settings.get("layer_types")  # Qwen2/3, Mistral-style configs: one type per layer
    if layer_types is not None or types:
        settings["layer_types"] = list(layer_types) if layer_types is not None else [types[i] for i in init_layers]
    config = AutoConfig.for_model(**settings)
    config.quantization_config = None
    del config.quantization_config
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    for mine, theirs in zip(draft.model.layers, init_layers):
        mine.load_state_dict(target.model.layers[theirs].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.model.embed_tokens = target.get_input_embeddings()
    draft.lm_head = SubsetHead(target.get_output_embeddings().weight.detach(), head_token_ids, config.vocab_size)
    return draft.to(next(target.parameters()).device)


def own_state_dict(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What a shared draft stores: everything but the shared embedding and head rows."""
    state = {k: v for k, v in draft.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}
    state["head_token_ids"] = draft.lm_head.token_ids
    return state


def save_shared_draft(draft: PreTrainedModel, out: Path, meta: dict, dtype: torch.dtype = torch.float16) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(out)
    state = {k: (v if k == "head_token_ids" else v.to(dtype)).contiguous().cpu() for k, v in own_state_dict(draft).items()}
    save_file(state, out / "weights.safetensors")
    embedding, head = draft.get_input_embeddings().weight, draft.lm_head.weight  # head: the rows the draft keeps
    samples = {"target_embedding_sample": embedding_sample(embedding), "target_head_sample": embedding_sample(head)}
    meta = {"format": 1, **meta, **samples}
    (out / "harness_draft.json").write_text(json.dumps(meta, indent=2) + "\n")


# What a shared draft assumes of its target: its shapes, and the settings its layers were trained under.
SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
SETTING_KEYS = ("head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "rope_theta", "attention_bias", "mlp_bias")
SAMPLE_ROWS = (0, 1, 2, 100, 1000)  # a few rows of the embedding table tell one target's weights from another's


def _same(a, b) -> bool:
    """Config values equal, floats to float32's precision (a GGUF stores rms_norm_eps 1e-6 as 9.99999997e-7)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _sample_matches(sample: list | None, weight: torch.Tensor) -> bool:
    """Whether `weight` shows the values recorded in `sample` (True when none was recorded: older drafts)."""
    if sample is None:
        return True
    here, there = torch.tensor(embedding_sample(weight)), torch.tensor(sample)
    return here.shape == there.shape and torch.allclose(here, there, rtol=2e-2, atol=1e-3)


def embedding_sample(weight: torch.Tensor) -> list[list[float]]:
    """The first 8 values of a few rows of an embedding table: a fingerprint of the weights that survives a dtype change."""
    rows = [r for r in SAMPLE_ROWS if r < weight.shape[0]]
    return weight[rows, :8].detach().float().cpu().tolist()


def load_shared_draft(path: Path, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    config = AutoConfig.from_pretrained(path)
    mismatched = [
        f"{key} {getattr(config, key, None)} vs {getattr(target.config, key, None)}"
        for key in (*SHAPE_KEYS, *SETTING_KEYS)
        if not _same(getattr(config, key, None), getattr(target.config, key, None))
    ]
    meta_path = path / "harness_draft.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if not mismatched and not _sample_matches(meta.get("target_embedding_sample"), target.get_input_embeddings().weight):
        mismatched.append("the embedding table's values")  # the same shapes and settings, but not the same weights
    if mismatched:
        raise HarnessError(
            f"draft '{path}' shares the weights of the target it was made for, and this target differs "
            f"({', '.join(mismatched)}; draft vs target): pair it with that target (see its harness_draft.json)"
        )
    if dtype != target.dtype:  # the embedding table and head are the target's own tensors
        raise HarnessError(
            f"draft '{path}' shares the target's embeddings and head, so it runs in the target's dtype "
            f"({str(target.dtype).removeprefix('torch.')}): drop pair.draft.dtype, or set the target's dtype instead"
        )
    state = load_file(path / "weights.safetensors")
    head_token_ids = state.pop("head_token_ids").to(next(target.parameters()).device)
    draft = build_shared_draft(target, config.num_hidden_layers, head_token_ids, layer_types=getattr(config, "layer_types", None))
    if not _sample_matches(meta.get("target_head_sample"), draft.lm_head.weight):  # an untied target's head: its own check
        raise HarnessError(
            f"draft '{path}' shares the weights of the target it was made for, and this target's LM head "
            f"differs: pair it with that target (see its harness_draft.json)"
        )
    missing, unexpected = draft.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not unexpected and all(k.startswith(("model.embed_tokens", "lm_head")) for k in missing), (missing, unexpected)
    draft.shares_target_weights = True  # same tokenizer as the target by construction
    return draft.to(dtype).eval()
