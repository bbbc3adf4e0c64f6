"""Which file of a saved model cannot be read, and why: a truncated file, another format under a weight
file's name, a shard the index lists but the folder lacks, a corrupt GGUF file, JSON that does not parse.
Only headers are read, so it is cheap; loading runs it when a load fails, to name the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import one_line

JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
INDEX = "model.safetensors.index.json"
SHARED_DRAFT = ("harness_draft.json", "weights.safetensors")  # harness.models.shared_draft's own files


def unreadable(folder: Path, gguf_file: str | None = None, weights: bool = True) -> tuple[Path, str] | None:
    """(file, why) for the first file of the model in `folder` that cannot be read; None when all can.
    weights=False: the JSON files only (what a tokenizer reads)."""
    checks = [(folder / name, json_problem) for name in JSON_FILES if (folder / name).exists()]
    if weights and gguf_file:
        checks.append((folder / gguf_file, gguf_problem))
    elif weights and (folder / SHARED_DRAFT[0]).exists():
        checks += [(folder / SHARED_DRAFT[0], json_problem), (folder / SHARED_DRAFT[1], safetensors_problem)]
    elif weights and (folder / INDEX).exists():
        if problem := json_problem(folder / INDEX):
            return folder / INDEX, problem
        weight_map = json.loads((folder / INDEX).read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            return folder / INDEX, "has no weight_map: it is not a safetensors index"
        checks += [(folder / shard, _listed_shard_problem) for shard in sorted(set(weight_map.values()))]
    elif weights and (folder / "model.safetensors").exists():
        checks.append((folder / "model.safetensors", safetensors_problem))
    return next(((path, problem) for path, problem_of in checks if (problem := problem_of(path))), None)


def unreadable_head(folder: Path, weight_files: tuple[str, ...]) -> tuple[Path, str] | None:
    """(file, why) for the first file of a feature head in `folder` that cannot be read: its config.json, then
    the first of `weight_files` present (the one it loads); None when both can."""
    checks = [(folder / "config.json", json_problem)]
    if weights := next((folder / name for name in weight_files if (folder / name).exists()), None):
        checks.append((weights, safetensors_problem if weights.suffix == ".safetensors" else torch_file_problem))
    return next(((path, problem) for path, problem_of in checks if (problem := problem_of(path))), None)


def json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_bytes())
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"is not valid JSON ({one_line(err)})"
    return None


def safetensors_problem(path: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        return "is missing"
    try:
        with safe_open(path, "pt"):  # reads the header and checks that the data it describes fills the file
            pass
    except (SafetensorError, OSError) as err:
        return f"is not a readable safetensors file ({one_line(err).removeprefix('Error while deserializing header: ')})"
    return None


def torch_file_problem(path: Path) -> str | None:
    """A torch.save file (pytorch_model.bin): a zip archive, whose central directory is read (the legacy
    pickle format is not checked)."""
    import zipfile

    if not path.exists():
        return "is missing"
    magic = b""
    try:
        with path.open("rb") as file:
            magic = file.read(4)
        if magic.startswith(b"\x80"):  # a pickle stream's protocol opcode: torch.save's legacy format
            return None
        with zipfile.ZipFile(path):
            pass
    except (zipfile.BadZipFile, OSError) as err:
        what = "a zip archive cut short" if magic.startswith(b"PK") else "neither a zip archive nor a pickle"
        return f"is not a readable PyTorch checkpoint ({what}: {one_line(err)})"
    return None


def _listed_shard_problem(path: Path) -> str | None:
    if not path.exists():
        return f"is missing ({INDEX} lists it)"
    return safetensors_problem(path)


def gguf_problem(path: Path) -> str | None:
    if not path.exists():
        return "is missing"
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers needs the gguf package to load the file at all, and says so
        return None
    try:
        GGUFReader(path)  # maps the file; reads its header, metadata and tensor table
    except Exception as err:  # the reader raises ValueError, struct.error, IndexError... on a damaged file
        return f"is not a readable GGUF file ({one_line(err, with_type=True)})"
    return None
