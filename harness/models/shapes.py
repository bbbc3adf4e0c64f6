"""Models of a named architecture with random weights (`shapes:NAME`): real costs without a download.

A step's cost depends on the shapes of the weights, not their values, so a target of Llama-3.1-8B's shapes
built with random weights costs per step what the trained one costs. `shapes:NAME` takes the architecture
from harness/assets/shapes/NAME.json (published configs' numbers) or from an HF config by id or folder,
`pair.<role>.config` overrides fields, and `pair.<role>.seed` seeds the weights, built directly on the
device in the run's dtype. Token ids come from SmolLM2's tokenizer (shipped on its own, harness/assets/
smollm2_tokenizer: no GGUF needed), wrapped to the model's vocabulary (`ShapesTokenizer`). Acceptance between random models means nothing: a run of such a pair is
cost-only (harness.core.metrics.cost_only_figures).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from harness.base.hub import hub_reachable
from harness.errors import HarnessError

PREFIX = "shapes:"
SHIPPED = Path(__file__).parents[1] / "assets" / "shapes"
TOKENIZER = Path(__file__).parents[1] / "assets" / "smollm2_tokenizer"  # SmolLM2-135M-Instruct's (Apache-2.0)
COST_ONLY = "random weights (shapes:): acceptance, tokens per cycle and speedup are not results; the costs are"


def is_shapes(model_id: str | None) -> bool:
    return bool(model_id) and str(model_id).startswith(PREFIX)


SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")


def shapes_config(model_id: str, overrides: dict | None = None):
    """The config of `shapes:NAME`: a shipped architecture, else an HF config by id or folder; `overrides` on top
    (fields the architecture does not have, and sizes that cannot build a model, are one line)."""
    name = model_id.removeprefix(PREFIX)
    shipped = SHIPPED / f"{name}.json"
    try:  # fields derived at init (head_dim) follow the overrides
        if shipped.exists():
            fields = json.loads(shipped.read_text())
        else:
            fields = AutoConfig.from_pretrained(name, local_files_only=not hub_reachable()).to_dict()
        defaults = AutoConfig.for_model(fields["model_type"]).to_dict()
    except (OSError, ValueError, KeyError) as err:
        known = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.json")))
        raise HarnessError(
            f"{model_id}: no such architecture ({str(err).splitlines()[0]}): use one of {known}, an HF id or a folder with a config.json"
        ) from None
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(fields) - set(defaults))
    try:
        config = AutoConfig.for_model(**{**fields, **overrides})
    except Exception as err:  # transformers validates a config as it is made (an odd head_dim for RoPE, say)
        reason = next((line.strip() for line in str(err).splitlines()[::-1] if line.strip()), type(err).__name__)
        raise HarnessError(f"{model_id}: transformers refuses its config ({reason}): fix pair.<role>.config") from None
    bad = [
        f"{key}={getattr(config, key)}"
        for key in SIZES
        if not (isinstance(getattr(config, key, 1), int) and getattr(config, key, 1) >= 1)
    ]
    heads, kv = getattr(config, "num_attention_heads", 1), getattr(config, "num_key_value_heads", 1)
    if not bad and heads % kv:
        bad.append(f"num_attention_heads={heads} not a multiple of num_key_value_heads={kv}")
    if unknown or bad:
        what = f"no field {', '.join(unknown)} in its config" if unknown else f"sizes that build no model ({'; '.join(bad)})"
        raise HarnessError(f"{model_id}: {what}: fix pair.<role>.config (whole numbers of at least 1)")
    return config


def architecture(config) -> str:
    """A model's shapes in one line (type, hidden, MLP, layers, heads, KV heads, vocabulary; a head's draft
    vocabulary): equal for a real model and the `shapes:` model of its config, so their cells can be joined."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    fields = [getattr(config, "model_type", "?")] + [f"{key}={getattr(config, key, None)}" for key in SIZES]
    if getattr(config, "draft_vocab_size", None):
        fields.append(f"draft_vocab_size={config.draft_vocab_size}")
    return " ".join(fields)


def _seeded(seed: int, device: torch.device):
    """A random state of its own for building weights: the run's global generator is left as it was."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def random_model(model_id: str, device: torch.device, dtype: torch.dtype, seed: int = 0, overrides: dict | None = None):
    """A causal LM of these shapes with random weights (the model class's own init, seeded), built on `device`."""
    config = shapes_config(model_id, overrides)
    try:
        with _seeded(seed, device), torch.device(device):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, RuntimeError, TypeError) as err:  # transformers' own checks of a config (an odd head_dim, say)
        raise HarnessError(
            f"{model_id}: its config builds no model ({str(err).strip().splitlines()[0]}): fix pair.<role>.config"
        ) from None
    model.generation_config.eos_token_id = None  # a cost-only run decodes every token it is asked for
    return model.eval().requires_grad_(False)


def random_head(model_id: str, layout: str, target, dtype: torch.dtype, seed: int = 0, overrides: dict | None = None):
    """A feature head of these shapes for `target`, random weights (seeded); an eagle3 head's draft vocabulary
    maps to the target's first tokens."""
    from harness.models.eagle import FeatureHead

    config = LlamaConfig(**shapes_config(model_id, overrides).to_dict())
    device = next(target.parameters()).device
    text = target.config.get_text_config(decoder=True)
    target_hidden = text.hidden_size
    if layout == "eagle3" and text.num_hidden_layers < 3:  # it reads the target's layers 2, L/2 and L-3
        raise HarnessError(
            f"{model_id}: an EAGLE-3 head reads three of the target's layers, and the target has "
            f"{text.num_hidden_layers}: give pair.target.config num_hidden_layers of at least 3"
        )
    if getattr(config, "draft_vocab_size", 0) > text.vocab_size:
        raise HarnessError(
            f"{model_id}: draft_vocab_size={config.draft_vocab_size} is more than the target's vocab_size={text.vocab_size}: "
            f"lower pair.draft.config.draft_vocab_size"
        )
    with _seeded(seed, device), torch.device(device):
        torch.manual_seed(seed)
        head = FeatureHead(layout, config, target, target_hidden)
    if layout == "eagle3":
        head.t2d[: head.draft_vocab] = True  # d2t stays 0: draft token j is target token j
    return head.to(dtype=dtype).eval().requires_grad_(False)


class ShapesTokenizer:
    """A tokenizer serving a random-weight model: the base's text handling, ids wrapped into the model's
    vocabulary (id mod V), and no end-of-sequence token, so that every prompt decodes all it is asked for."""

    eos_token_id = None

    def __init__(self, base, vocab: int):
        self.base, self.vocab = base, vocab

    def __getattr__(self, name):
        return getattr(self.base, name)

    def __len__(self) -> int:
        return min(len(self.base), self.vocab)

    def __call__(self, text, **kwargs):
        ids = self.base(text, **kwargs)["input_ids"]
        return {"input_ids": [i % self.vocab for i in ids]}
