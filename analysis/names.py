"""What the report calls things: prompt sets, drafts, sampling settings and run setups.

Names decide what is compared with what: prompts pair by (dataset name, id),
a fit and a decision hold one setup, and two drafts never share a label.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

# What a deployment fixes, so what one decision holds: the target, the sampling setting and the run setup.
CONTEXT_KEYS = ["target", "sampling", "setup"]
# The run conditions that change what a speedup means: a decision or a fit holds one value of each.
CONDITION_KEYS = ("device_name", "dtype", "max_new_tokens", "cache", "compile", "forward", "prompt_format", "batch_size")
# Dataset settings that decide which text a prompt id names (not which ids run: num_prompts,
# max_rows): cells of one dataset name that differ in one are different prompt sets.
TEXT_FIELDS = ("source", "text_field", "template", "id_field")  # source: the file, or the hub set and split


def dataset_names(rows: list[dict]) -> None:
    """Give each prompt set its own name, so that prompts of different sets never pair by id.

    Each row holds `dataset` (the config's name), `dataset_file` (its path, None for the hub and
    the builtin set), `dataset_sha256` (the summary's SHA-256 of that file) and `dataset_text`
    (text_settings); `dataset` is renamed in place and the other three are dropped.

    A local file is `local:<file name>` (every local file runs as dataset `local`, and ids like
    local-0 recur from file to file). Where cells of one such name read files of different
    contents (also a hub set's local copy), each content gets its SHA's first 6 hex digits after
    the name; a cell that read the hub gets none. Where cells of one name differ in a TEXT_FIELDS
    setting (another split or file, another template), the name gets the settings that differ,
    e.g. `gsm8k[source=openai/gsm8k:train]`."""
    for row in rows:
        if row["dataset"] == "local" and row["dataset_file"]:
            row["dataset"] = f"local:{Path(str(row['dataset_file'])).name}"
    contents: dict[str, set[str]] = {}
    for row in rows:
        if row["dataset_sha256"]:
            contents.setdefault(row["dataset"], set()).add(row["dataset_sha256"])
    for row in rows:
        if len(contents.get(row["dataset"], ())) > 1 and row["dataset_sha256"]:
            row["dataset"] += f"#{row['dataset_sha256'][:6]}"
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["dataset"], []).append(row)
    for group in groups.values():
        differ = [f for f in TEXT_FIELDS if len({_short(r["dataset_text"][f]) for r in group}) > 1]
        for row in group:
            if differ:
                row["dataset"] += "[" + ", ".join(f"{f}={_short(row['dataset_text'][f])}" for f in differ) + "]"
    for row in rows:
        del row["dataset_file"], row["dataset_sha256"], row["dataset_text"]


def text_settings(dataset: dict) -> dict:
    """The TEXT_FIELDS of a dataset config (see dataset_names). `source` is where the text comes
    from: the file's name where `path` is set (a hub set read from a local copy reads the file,
    whatever its hf_id and split say), else hf_id, hf_config and split (and a pinned revision),
    else the config's source (builtin)."""
    settings = {f: dataset[f] for f in ("text_field", "template", "id_field")}
    if dataset.get("path"):
        settings["source"] = Path(str(dataset["path"])).name
    elif dataset.get("hf_id"):
        settings["source"] = ":".join(str(dataset[f]) for f in ("hf_id", "hf_config", "split") if dataset.get(f) is not None)
        if dataset.get("revision"):  # a pinned revision is other rows, perhaps
            settings["source"] += f"@{dataset['revision']}"
    else:
        settings["source"] = str(dataset["source"])
    return settings


def _short(value: Any) -> str:
    """A setting as a name can show it: as it is when short and plain, else `sha-` and 6 hex digits."""
    text = "none" if value is None else str(value)
    return text if re.fullmatch(r"[\w./:-]{1,40}", text) else f"sha-{hashlib.sha256(text.encode()).hexdigest()[:6]}"


def sampling_name(temperature: float, top_k: int = 0, top_p: float = 1.0) -> str:
    """'T=1 top_k=50 top_p=0.9': what names (and so groups) a sampling setting. At temperature 0 the
    harness decodes greedily and ignores top_k and top_p (harness.core.sampling.Sampling.greedy), so every
    greedy cell is 'T=0', one context, whatever top_k and top_p it was configured with."""
    if temperature == 0:
        top_k, top_p = 0, 1.0
    name = f"T={temperature:g}"
    if top_k:
        name += f" top_k={top_k}"
    if top_p < 1.0:
        name += f" top_p={top_p:g}"
    return name


def variant(model: dict) -> str:
    """What makes another model of one id: '@v2' for a revision other than the hub's default branch,
    '[model-q4.gguf]' for a GGUF file of the repo."""
    revision, gguf = model.get("revision"), model.get("gguf_file")
    return ("" if revision in (None, "", "main") else f"@{revision}") + (f"[{gguf}]" if gguf else "")


def draft_labels(cells: pd.DataFrame) -> pd.Series:
    """A short name per draft: the pair name, qualified when one pair name covers several drafts
    (by the shortest end of the drafts' ids that tells them apart: `pair/final` or `pair/a/final`;
    prompt lookup by its whole setting, `ngram(1-3)`), so that two drafts never share a label."""
    pairs = pd.Series([p if isinstance(p, str) else "unnamed" for p in cells["pair"]], index=cells.index)  # a null name too
    variants = dict(zip(cells["draft"].astype(str), cells["draft_variant"].fillna("")))
    short: dict[tuple[str, str], str] = {}
    for pair, drafts in cells["draft"].groupby(pairs):
        ids = sorted(set(map(str, drafts)))
        if len(ids) == 1:
            short[(pair, ids[0])] = str(pair)
            continue
        # Split the path only: a revision like refs/pr/3 stays whole after it.
        parts = {d: d[: len(d) - len(variants.get(d, ""))].split("/") for d in ids}
        for depth in range(1, max(map(len, parts.values())) + 1):
            ends = {d: "/".join(p[-depth:]) + variants.get(d, "") for d, p in parts.items()}
            if len(set(ends.values())) == len(ids):
                break
        short.update({(pair, d): f"{pair}/{end}" for d, end in ends.items()})
    return pd.Series([short[(pair, str(draft))] for pair, draft in zip(pairs, cells["draft"])], index=cells.index)


def device_label(conditions: dict) -> str:
    """The device as the harness keys cells by it: a GPU's model; a CPU's model and its
    torch threads (its timings depend on both), e.g. "AMD EPYC, 2 threads", and ", W @ x.T"
    when its linear layers took few rows that way (harness.models.cpu_linear; torch's product otherwise)."""
    name = str(conditions["device_name"])
    if str(conditions["device"]).startswith("cpu"):
        transposed = (conditions.get("linear") or {}).get("product") == "transposed"  # recorded where a plan was made
        return f"{name}, {conditions['threads']} threads" + (", W @ x.T" if transposed else "")
    return name


def describe(row: Any, keys: Iterable[str]) -> str:
    """'device=NVIDIA H200, dtype=bfloat16' for the given identity keys of a row (a target by its id alone)."""

    def value(key: str) -> str:
        v = row[key]
        if isinstance(v, float):
            return "unknown" if v != v else f"{v:g}"
        return str(v)

    return ", ".join(value(k) if k == "target" else f"{k.removesuffix('_name')}={value(k)}" for k in keys)


def varying(cells: pd.DataFrame, keys: Iterable[str] = ("target", *CONDITION_KEYS)) -> list[str]:
    """The keys that take more than one value across the cells."""
    return [k for k in keys if cells[k].astype(str).nunique() > 1]


def names(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per (target, setup, label): `where`, the target and run conditions that differ between the
    cells ('' when none do), and `name`, the label followed by it: what a figure or table calls the draft,
    so that cells of two targets or two devices are never drawn or listed as one."""
    keys = varying(cells)
    out = cells.drop_duplicates(["target", "setup", "label"]).reset_index(drop=True)
    out["where"] = [describe(row, keys) for _, row in out.iterrows()]
    out["name"] = [f"{label} · {where}" if where else label for label, where in zip(out["label"], out["where"])]
    return out[["target", "setup", "label", "where", "name"]]
