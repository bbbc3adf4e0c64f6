"""Loading target and draft models and their tokenizers, with one line for what cannot be loaded.

A model spec names an HF hub id or a local folder (`id`), with `revision`, `dtype` and optionally a
`gguf_file`. Special ids: `embedded:<name>` (harness.models.embedded), and a folder holding
`harness_draft.json` (a draft sharing its target's weights: harness.models.shared_draft), and
`shapes:<name>` (an architecture with random weights, `seed` and `config` overrides: harness.models.shapes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from harness.base.hub import hub_reachable
from harness.errors import HarnessError
from harness.models.integrity import unreadable
from harness.models.shapes import TOKENIZER, ShapesTokenizer, is_shapes, random_model, shapes_config

# Models load as their own modules: transformers 5.25 swaps in hub kernels by default, which makes what is
# measured depend on the network and the hub's state that day (False: 5.24's default).
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
    seed: int = 0  # shapes: the random weights' seed
    config: Any = None  # shapes: fields over the architecture's config

    @classmethod
    def from_config(cls, cfg) -> ModelSpec:
        from omegaconf import OmegaConf

        fields = {f: cfg[f] for f in cls.__dataclass_fields__ if f in cfg and cfg[f] is not None}
        if "config" in fields:
            fields["config"] = OmegaConf.to_container(fields["config"], resolve=True)
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
        raise HarnessError(
            f"device={device} was asked for but this process sees {torch.cuda.device_count()} GPU(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1} (CUDA_VISIBLE_DEVICES renumbers them from 0)"
        )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise HarnessError(f"dtype={dtype!r} is not supported: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _load_error(model_id: str, role: str, kwargs: dict, err: OSError) -> HarnessError:
    """One line for a model or tokenizer that would not load: offline and not cached, how to get it; else transformers' reason."""
    if kwargs.get("local_files_only"):
        hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        return HarnessError(
            f"{role} model '{model_id}' is neither in the HF cache ({hf_home}) nor reachable on the hub: "
            f"download it where the hub is reachable (hf download {model_id}), point HF_HOME at a cache "
            f"that holds it, or give a local directory (pair.{role}.id=/path/to/model)"
        )
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return HarnessError(
        f"{role} model '{model_id}' could not be loaded: {reason} (check pair.{role}.id and pair.{role}.revision; a gated repo needs `hf auth login`)"
    )


def _hub_kwargs(spec: ModelSpec, source: str) -> dict:
    kwargs = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    if not Path(source).exists():  # a hub id: use the cache alone when the hub is out of reach
        kwargs["local_files_only"] = not hub_reachable()
    return kwargs


def resolve_source(spec: ModelSpec, role: str) -> tuple[str, str | None]:
    """(path or hub id, gguf file name) to hand to from_pretrained."""
    if spec.id.startswith("embedded:"):
        from harness.models.embedded import embedded_model_dir

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


def _damaged(spec: ModelSpec, role: str, source: str, gguf_file: str | None, weights: bool = True) -> HarnessError | None:
    """The one line for a model with a file that cannot be read (harness.models.integrity), naming the file and the
    fix for where it lies; None if none."""
    from harness.models.embedded import EMBEDDED

    folder = Path(source) if Path(source).exists() else _hub_cache_folder(spec, gguf_file)
    found = unreadable(folder, gguf_file, weights) if folder is not None else None
    if found is None:
        return None
    path, problem = found
    name = spec.id.removeprefix("embedded:")
    if spec.id.startswith("embedded:") and name in EMBEDDED:
        fix = f"delete the folder {folder} so that the next run rebuilds it"
    elif spec.id.startswith("embedded:"):
        fix = "the harness's installation is damaged: reinstall it"
    elif not Path(source).exists():
        fix = f"delete that cache entry (hf cache rm model/{spec.id}) and download it again (hf download {spec.id})"
    else:
        fix = f"download or save the model into {folder} again (an interrupted download leaves files cut short or missing), or delete that folder"
    return HarnessError(f"{role} model '{spec.id}' cannot be read: {path} {problem}: {fix}")


def _hub_cache_folder(spec: ModelSpec, gguf_file: str | None) -> Path | None:
    """The HF cache's snapshot folder for a hub id, where it holds the model's config (or GGUF file)."""
    from huggingface_hub import try_to_load_from_cache

    name = gguf_file or "config.json"
    try:
        found = try_to_load_from_cache(spec.id, name, revision=spec.revision)
    except ValueError:  # not a valid repo id
        return None
    return Path(found).parents[len(Path(name).parts) - 1] if isinstance(found, str) else None


def load_tokenizer(spec: ModelSpec, role: str = "target"):
    if is_shapes(spec.id):  # SmolLM2's tokenizer (shipped alone: no GGUF), its ids wrapped into the model's vocabulary
        return ShapesTokenizer(AutoTokenizer.from_pretrained(TOKENIZER), shapes_config(spec.id, spec.config).vocab_size)
    source, gguf_file = resolve_source(spec, role)
    kwargs = _hub_kwargs(spec, source)
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as err:  # the tokenizers library raises plain Exceptions on a file that does not parse
        if (damaged := _damaged(spec, role, source, gguf_file, weights=False)) is not None:
            raise damaged from err
        if isinstance(err, OSError):
            raise _load_error(spec.id, role, kwargs, err) from err
        if isinstance(err, ValueError):  # e.g. a directory saved without its tokenizer files
            raise HarnessError(
                f"{role} model '{spec.id}' has no tokenizer transformers can load ({str(err).splitlines()[0]}): "
                f"save its tokenizer beside the weights (tokenizer.save_pretrained)"
            ) from err
        raise


def load_model(spec: ModelSpec, device: torch.device, role: str = "target", target: PreTrainedModel | None = None):
    """A causal LM in eval mode on `device`. A shared-weights draft needs its target."""
    dtype = resolve_dtype(spec.dtype, device)
    if is_shapes(spec.id):
        return random_model(spec.id, device, dtype, spec.seed, spec.config)
    source, gguf_file = resolve_source(spec, role)
    if (Path(source) / "harness_draft.json").exists():
        from harness.models.shared_draft import load_shared_draft

        if target is None:
            raise HarnessError(f"draft '{spec.id}' shares weights with its target and must be loaded with it")
        try:
            return load_shared_draft(Path(source), target, dtype)
        except HarnessError:
            raise
        except Exception as err:  # safetensors, json and transformers' errors on a damaged folder
            if (damaged := _damaged(spec, role, source, None)) is not None:
                raise damaged from err
            raise
    kwargs = {**_hub_kwargs(spec, source), "dtype": dtype, **PLAIN}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except Exception as err:  # a damaged file raises whatever its reader raises (SafetensorError, struct.error...)
        if (damaged := _damaged(spec, role, source, gguf_file)) is not None:
            raise damaged from err
        if isinstance(err, OSError):
            raise _load_error(spec.id, role, kwargs, err) from err
        if isinstance(err, ValueError):
            raise HarnessError(f"{role} model '{spec.id}' could not be loaded as a causal LM: {err}".splitlines()[0]) from err
        raise
    if not spec.device_map:
        model = model.to(device)
    return model.eval()


def check_same_vocabulary(target_tok, draft_tok) -> int:
    """The vocabulary size the rule compares on, or an error if the tokenizers differ (embedding tables padded
    to other sizes are fine: the rule works on the tokenizer's range)."""
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
