"""Draft size: parameters and weight memory, for speedup against draft size.

In order of preference:
  run        `draft_params` / `draft_bytes` recorded in the cell's summary
  ngram      prompt lookup has no weights: 0 parameters, 0 bytes
  weights    the safetensors headers of a local directory, a shipped
             embedded draft or an HF cache snapshot: exact (tensor shapes are
             in the 8-byte-length-prefixed JSON header; no weights are read)
  config     config.json alone: a rough Llama-style count (embeddings,
             attention with grouped KV heads, gated MLP, norms, head)
  unknown    none of these are here: NaN
Memory is parameters x the bytes per element of the run's dtype (the weights
as they sat in memory, not as stored on disk). A draft that shares its
target's embeddings (harness.models.shared_draft) counts its own layers and its
subset head only: the shared rows cost nothing extra.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def draft_size(kind: str, draft_id: str | None, dtype: str | None, summary: dict | None = None) -> dict:
    """{"params", "bytes", "source"} of a draft (see the module docstring)."""
    summary = summary or {}
    if summary.get("draft_params") is not None:
        params = float(summary["draft_params"])
        size = summary.get("draft_bytes")
        return {"params": params, "bytes": float(size) if size is not None else _bytes(params, dtype), "source": "run"}
    if kind == "ngram":
        return {"params": 0.0, "bytes": 0.0, "source": "ngram"}
    params, source = _params(str(draft_id)) if draft_id else (math.nan, "unknown")
    return {"params": params, "bytes": _bytes(params, dtype), "source": source}


def _bytes(params: float, dtype: str | None) -> float:
    return params * ITEMSIZE.get(dtype or "float32", 4)


@functools.cache
def _params(draft_id: str) -> tuple[float, str]:
    directory = model_dir(draft_id)
    if directory is None:
        return math.nan, "unknown"
    files = sorted(directory.glob("*.safetensors"))
    if files:
        shapes = {name: shape for f in files for name, shape in safetensors_shapes(f).items()}
        own = sum(math.prod(s) for name, s in shapes.items() if name != "head_token_ids")
        if "head_token_ids" in shapes and (directory / "config.json").exists():  # shared draft: its subset head is a copy
            hidden = json.loads((directory / "config.json").read_text()).get("hidden_size", 0)
            own += shapes["head_token_ids"][0] * hidden
        return float(own), "weights"
    if (directory / "config.json").exists():
        return float(rough_params(json.loads((directory / "config.json").read_text()))), "config"
    return math.nan, "unknown"


def model_dir(draft_id: str) -> Path | None:
    """The local directory holding a draft's files, if any (never downloads)."""
    if draft_id.startswith("embedded:"):
        from harness.models.embedded import EMBEDDED, SHIPPED_DRAFTS, cache_root

        name = draft_id.removeprefix("embedded:")
        if name in SHIPPED_DRAFTS:
            return SHIPPED_DRAFTS[name] if SHIPPED_DRAFTS[name].exists() else None
        path = cache_root() / EMBEDDED.get(name, name)
        return path if path.exists() else None
    path = Path(draft_id).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(draft_id, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's header only."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: meta["shape"] for name, meta in header.items() if name != "__metadata__"}


def rough_params(config: dict) -> int:
    """A Llama-style parameter count from config.json (within a few percent for Llama, Qwen, Mistral)."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    layers, inter = config["num_hidden_layers"], config.get("intermediate_size", 4 * hidden)
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    mlp = 3 * hidden * inter
    head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden + head
