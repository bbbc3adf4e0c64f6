"""Files: atomic writes, content digests, and the harness's cache folder."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a reader sees the old file or the new, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one a process: parallel jobs may write one file at once
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """`obj` as indented JSON, written atomically (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def save_atomically(obj, path: Path) -> None:
    """torch.save to a temporary name, then rename: an interrupted save is never loaded as the data."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


def json_digest(obj: Any, length: int = 64) -> str:
    """The first `length` hex digits of the SHA-256 of `obj` as JSON with sorted keys: a key for settings."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:length]


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    """Where the harness keeps what it fetches and measures once: $SPECBENCH_CACHE, else $XDG_CACHE_HOME/specbench-harness."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specbench-harness"
    return Path(os.environ.get("SPECBENCH_CACHE", default))
