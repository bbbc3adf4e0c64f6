"""A cell's results on disk: its key and folder, and its prompt records.

`<out_dir>/<cell key>/` holds config.yaml, prompts.jsonl (a record per prompt, appended as each
finishes), status.json and summary.json, each JSON `stamped`. Torch-free at import (the aggregate and
the analysis only read results).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from harness.base.files import file_sha256, json_digest

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 1  # the layout of summary.json, status.json and the prompts.jsonl records

# Keys that do not change a cell's results: they stay out of its key.
NOT_IN_KEY = ("out_dir", "force", "wandb", "default_pair")


def stamped(result: dict, started_utc: str) -> dict:
    """`result` led by the schema version and the UTC time (ISO 8601) its run started."""
    return {"schema_version": SCHEMA_VERSION, "started_utc": started_utc, **result}


def cell_key(cfg: DictConfig, device: torch.device | None = None) -> str:
    """`<pair>-k<k>-t<temperature>[-b<batch_size>]-<hash>`, the hash over the resolved config less NOT_IN_KEY, with
    `device` (default: cfg.device resolved here) and every dtype as they resolve on this machine, so that a
    CPU and a GPU process sharing out_dir never share a cell."""
    from harness.base.device import device_identity
    from harness.models.loading import resolve_device, resolve_dtype

    device = device if device is not None else resolve_device(cfg.device)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    keyed = {k: v for k, v in resolved.items() if k not in NOT_IN_KEY}
    keyed["device"] = device_identity(device)
    if device.type != "cpu":
        keyed.pop("cpu_linear", None)  # it changes nothing off the CPU
    elif keyed.get("cpu_linear") == "probe":
        keyed["cpu_linear"] = "auto"  # a re-probe of the plan auto uses: the same cell
    if keyed.get("forward", "hf") == "hf" or (keyed["forward"] == "auto" and device.type != "cpu"):
        keyed.pop("forward", None)  # HF's forward (auto's off the CPU), as before the setting existed: the same cells
    pair = keyed["pair"]
    models = [pair["target"]] + ([pair["draft"]] if pair["draft"].get("kind") != "ngram" else [])  # drafts with weights
    for node in (keyed, *models):  # the top-level dtype, and each model's (a pair may pin its own)
        node["dtype"] = str(resolve_dtype(node.get("dtype") or "auto", device)).removeprefix("torch.")
    if keyed.get("batch_size", 1) == 1:
        keyed.pop("batch_size", None)  # one sequence at a time, as before the setting existed: the same cells
    for name in ("temperature", "top_p"):  # temperature=0 and temperature=0.0 are one cell
        if isinstance(keyed.get(name), (int, float)):
            keyed[name] = float(keyed[name])
    if keyed["dataset"].get("revision", "") is None:  # unpinned, as before the setting existed: the same cells
        del keyed["dataset"]["revision"]
    if (sha256 := dataset_sha256(cfg)) is not None:  # an edited file is another prompt set
        keyed["dataset"]["file_sha256"] = sha256
    policy = (keyed.get("draft_length") or {}).get("policy", "constant")
    if policy == "constant":
        keyed.pop("draft_length", None)  # k every cycle, as before the setting existed: the same cells
    if keyed.get("tree") is None:
        keyed.pop("tree", None)  # a chain, as before the setting existed: the same cells
        for name, default in (("tree_candidates", "top"), ("tree_nodes", 8), ("tree_topk", 4)):
            if keyed.get(name) == default:
                keyed.pop(name)
    digest = json_digest(keyed, 10)
    batch = f"-b{cfg.batch_size}" if cfg.get("batch_size", 1) > 1 else ""
    length = "" if policy == "constant" else f"-{policy}"
    shape = cfg.get("tree")
    tree = "" if shape is None else f"-treedyn{cfg.tree_nodes}" if shape == "dynamic" else "-tree" + "x".join(map(str, shape))
    return f"{cfg.pair.name}-k{cfg.k}-t{float(cfg.temperature)}{batch}{length}{tree}-{digest}"


def cell_path(cfg: DictConfig, out_dir: str | Path | None = None, device: torch.device | None = None) -> Path:
    """Where a cell's results go: <out_dir>/<cell key> (out_dir: cfg.out_dir unless given)."""
    return Path(out_dir if out_dir is not None else cfg.out_dir) / cell_key(cfg, device)


def dataset_sha256(cfg: DictConfig) -> str | None:
    """The SHA-256 of the file a prompt set is read from (`dataset.path`), or None (the hub or the builtin set)."""
    data_file = Path(str(cfg.dataset.get("path") or "")).expanduser()
    return file_sha256(data_file) if data_file.is_file() else None


def read_records(path: Path, trim: bool = False) -> list[dict]:
    """The prompt records up to the first line that does not parse (cut by a kill: redone). trim: also cut the
    file back to those records, each ending its line, for a resumed run to append to."""
    if not path.exists():
        return []
    data = path.read_bytes()
    records, good = [], 0
    for line in data.splitlines(keepends=True):
        try:
            records.append(json.loads(line))
        except ValueError:
            break
        good += len(line)
    if trim and (good < len(data) or not data.endswith(b"\n")):
        with path.open("r+b") as f:
            f.truncate(good)
            if good and not data[:good].endswith(b"\n"):
                f.seek(good)
                f.write(b"\n")
    return records
