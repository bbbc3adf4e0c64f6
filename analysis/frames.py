"""The one schema every later step reads: raw cells -> the cells and prompts frames.

A *cell* is one benchmark run (a pair, a k, a sampling setting, a prompt
set). Whatever its source (harness.runner.cell.run_cell's folder or a W&B
run, analysis.load), it arrives as a RawCell (config, summary, records),
and `frames` turns raw cells into:

  cells    one row per cell: identity (target, draft, label, dataset, k,
           sampling), the summary metrics, the measured costs, the draft
           size, and its run conditions (CONDITION_KEYS: device name,
           dtype, max_new_tokens, KV cache, compile, forward, prompt
           format) joined into one `setup` string: a decision or a fit
           never mixes two setups
  prompts  one row per cell x prompt: the counts and timings of both paths

A cell key seen twice on one device is one cell (the first is used). One
key can carry two device labels (a CPU's linear product, which
cpu_linear=auto picks as the models load, is part of the label but not of
the key): both are kept, each `cell` suffixed `@<device name>`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analysis.names import (
    CONDITION_KEYS,
    dataset_names,
    describe,
    device_label,
    draft_labels,
    sampling_name,
    text_settings,
    variant,
)
from analysis.shapes import shape_row

# Summary scalars copied into the cells frame as they are.
SUMMARY_SCALARS = (
    "num_prompts",
    "alpha",
    "acceptance_rate",
    "expected_alpha",
    "tokens_per_cycle",
    "theoretical_tokens_per_cycle",
    "accepted_per_cycle",
    "speedup",
    "speedup_geomean",
    "decode_speedup",
    "predicted_speedup",
    "efficiency",
    "efficiency_isolated",
    "cost_ratio",
    "verify_cost",
    "cycles",
    "new_tokens",
    "base_new_tokens",
    "spec_time_s",
    "base_time_s",
    "spec_tpot_s",
    "base_tpot_s",
    "spec_ttft_s",
    "base_ttft_s",
    "max_new_tokens",
    "peak_rss_mb",
)
# Per-prompt fields of the speculative path kept in the prompts frame.
SPEC_FIELDS = ("cycles", "committed", "drafted", "accepted", "tested", "new_tokens", "time_s")
# A cell's own speedup interval (summary.json's speedup_ci): harness.core.metrics computes it at 95%.
CELL_CONFIDENCE = 0.95


@dataclass
class RawCell:
    """What one cell is made of, whatever the source."""

    config: dict  # the resolved Hydra config
    summary: dict  # summary.json (or the W&B run summary)
    records: list[dict] | None  # prompts.jsonl lines; None when the source has none
    origin: str  # where it came from (a directory or a W&B run path)


@dataclass
class Results:
    cells: pd.DataFrame
    prompts: pd.DataFrame
    source: str
    kind: str  # "local" or "wandb"
    notes: list[str] = field(default_factory=list)  # cells left out, and why
    shapes: pd.DataFrame = field(default_factory=pd.DataFrame)  # cost-only cells (analysis.shapes.shape_row)


def frames(raws: Iterable[RawCell], source: str, kind: str, notes: list[str] | None = None) -> Results:
    """The cells and prompts frames of raw cells (duplicates of a cell key on one device are dropped).

    One cell key under several device labels keeps a row per label, its `cell` qualified by the
    device name so that every row's `cell` is unique."""
    notes = list(notes or [])
    kept, seen, shape_rows = [], {}, []  # (cell, device) -> the first raw cell of it
    for raw in raws:
        if raw.summary.get("cost_only"):  # random weights: costs and a predicted grid, no acceptance to decide on
            shape_rows.append(shape_row(raw.summary, raw.config, raw.origin))
            continue
        row = cell_row(raw)
        key = (row["cell"], row["device_name"])
        if key in seen:
            if not (
                raw.summary.get("reused") or seen[key].summary.get("reused")
            ):  # a sweep's run of a complete cell logs it again
                notes.append(
                    f"cell {row['cell']} on {row['device_name']} found twice ({seen[key].origin}, {raw.origin}): the first is used"
                )
            continue
        seen[key] = raw
        kept.append((row, raw.records))
    dataset_names([row for row, _ in kept])
    devices = Counter(row["cell"] for row, _ in kept)
    cell_rows, prompt_rows = [], []
    for row, records in kept:
        if devices[row["cell"]] > 1:
            row["cell"] = f"{row['cell']}@{row['device_name']}"
        cell_rows.append(row)
        for r in records or []:
            prompt_rows.append(prompt_row(row["cell"], r, row["dataset"]))
    cells, shapes = pd.DataFrame(cell_rows), pd.DataFrame(shape_rows)
    if cells.empty:
        return Results(cells, pd.DataFrame(), source, kind, notes, shapes)
    cells["label"] = draft_labels(cells)
    cells = cells.sort_values(["target", "setup", "label", "dataset", "sampling", "k"], kind="stable").reset_index(drop=True)
    prompts = pd.DataFrame(prompt_rows)
    if not prompts.empty:
        keys = cells[["cell", "target", "setup", "label", "draft_kind", "dataset", "sampling", "temperature", "k"]]
        prompts = prompts.merge(keys, on="cell", how="left")
    return Results(cells, prompts, source, kind, notes, shapes)


def verify_width(label: str, k: int) -> int:
    """Positions a cycle's verify pass scores (the last committed token and the drafts) of a candidate labelled as
    `cell_row` labels it: k + 1 for a chain (any draft-length policy: its cap), nodes + 1 for a token tree
    (`~tree3x2x1`: the nodes of those children per depth, `~treedyn8`: 8)."""
    suffix = label.partition("~")[2].removesuffix("-sampled")
    if suffix.startswith("treedyn"):
        return int(suffix.removeprefix("treedyn")) + 1
    if suffix.startswith("tree"):
        level = nodes = 1
        for width in suffix.removeprefix("tree").split("x"):
            level *= int(width)
            nodes += level
        return nodes
    return k + 1


def cell_row(raw: RawCell) -> dict:
    """One row of the cells frame: what the summary and the config say of one cell."""
    s, cfg = raw.summary, raw.config
    if "efficiency_in_run" in s:  # written before the in-run efficiency became the headline `efficiency`
        s = {**s, "efficiency": s["efficiency_in_run"], "efficiency_isolated": s["efficiency"]}
    pair, costs, conditions, dataset = cfg["pair"], s["costs"], s["conditions"], cfg["dataset"]
    draft = pair["draft"]
    kind = draft["kind"]
    if kind == "ngram":
        length = draft.get("length", "match")  # the prompt-lookup settings a pair may leave to the drafter's defaults
        draft_id = f"ngram({draft.get('min_ngram', 1)}-{draft.get('max_ngram', 3)})" + ("" if length == "match" else f"-{length}")
        draft_variant = ""
    else:
        draft_id = str(s["draft"]).rstrip("/") or "/"  # a folder named with or without its slash: one draft
        dtype = _resolved_dtype(draft.get("dtype"), conditions)
        draft_variant = variant(draft) + (f"[{dtype}]" if dtype and dtype != conditions["dtype"] else "")
        draft_id += draft_variant  # a draft in another dtype than its target is another draft
    policy = (cfg.get("draft_length") or {}).get("policy", "constant")
    if policy != "constant":  # a draft-length policy other than k every cycle: another contender (harness.core.lengths)
        draft_id += f"~{policy}"
        draft_variant += f"~{policy}"
    if s.get("tree"):  # a token tree, static or dynamic: another contender (harness.core.tree_shapes)
        tree = s["tree"]
        shape = f"treedyn{tree['nodes']}" if tree["shape"] == "dynamic" else "tree" + "x".join(map(str, tree["shape"]))
        shape += "-sampled" if tree.get("candidates") == "sampled" else ""
        draft_id += f"~{shape}"
        draft_variant += f"~{shape}"
    temperature = float(s["temperature"])
    top_k, top_p = int(s["top_k"] or 0), float(s["top_p"] or 1.0)
    hist = list(s["accept_hist"])
    row = {
        "cell": s["cell"],
        "origin": raw.origin,
        "pair": s["pair"],
        "target": (str(s["target"]).rstrip("/") or "/") + variant(pair["target"]),
        "draft": draft_id,
        "draft_variant": draft_variant,  # the end of `draft` that is no part of its path
        "draft_kind": kind,
        "dataset": str(dataset["name"]),
        "dataset_file": dataset.get("path"),  # dataset_names reads these three, then drops them
        "dataset_sha256": s["dataset_sha256"],
        "dataset_text": text_settings(dataset),
        "k": int(s["k"]),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "sampling": sampling_name(temperature, top_k, top_p),
        "seed": cfg["seed"],
        # Which prompts the cell ran: cells compared on summaries alone must match.
        "prompt_set": hashlib.sha256(json.dumps(sorted(map(str, s["prompt_ids"]))).encode()).hexdigest()[:12],
        **{key: _num(s.get(key)) for key in SUMMARY_SCALARS},
        "speedup_ci_low": _num(s["speedup_ci"][0]),
        "speedup_ci_high": _num(s["speedup_ci"][1]),
        "speedup_geomean_ci_low": _num(s["speedup_geomean_ci"][0]),
        "speedup_geomean_ci_high": _num(s["speedup_geomean_ci"][1]),
        "target_step_s": _num(costs["target_step_s"]),
        "draft_step_s": _num(costs["draft_step_s"]),
        "verify_costs": list(costs["verify_cost"]),  # v(n) for n = 1..k+1
        "position_acceptance": [_num(a) for a in s["position_acceptance"]],
        "accept_hist": hist,
        # Without per-prompt rows (a W&B run without its artifact): accepted drafts are exact from the
        # histogram, tested positions from alpha = accepted / tested (below).
        "accepted_total": float(sum(j * n for j, n in enumerate(hist))),
        "tested_total": float("nan"),
        "device": conditions["device"],
        # The run conditions (CONDITION_KEYS); the harness records cache and compile in the config.
        "device_name": device_label(conditions),
        "dtype": str(conditions["dtype"]),
        "cache": str(cfg["cache"]),
        "compile": str(cfg["compile"]),
        "forward": str(conditions["forward"]),
        "prompt_format": _prompt_format(cfg),
        "batch_size": int(cfg.get("batch_size", 1)),  # prompts decoded together (harness.core.loop)
        "has_prompts": raw.records is not None and len(raw.records) > 0,
        # The draft's own weights as they sat in memory (harness.runner.pair.draft_size): 0 for prompt lookup.
        "draft_params": _num(s["draft_params"]),
        "draft_bytes": _num(s["draft_bytes"]),
        # The models' shapes (harness.runner.pair.architectures): cost-only cells of the same shapes join on them.
        "target_arch": (s.get("architectures") or {}).get("target"),
        "draft_arch": (s.get("architectures") or {}).get("draft"),
    }
    if raw.records:  # exact counts
        row["accepted_total"] = float(sum(r["spec"]["accepted"] for r in raw.records))
        row["tested_total"] = float(sum(r["spec"]["tested"] for r in raw.records))
        row["position_reached"] = _sum_lists(r["spec"]["position_reached"] for r in raw.records)
        row["position_accepted"] = _sum_lists(r["spec"]["position_accepted"] for r in raw.records)
    else:  # only the ratios are known; weight positions by cycles
        alpha = row["alpha"]
        if alpha == alpha and alpha > 0:  # tested = accepted / alpha, whatever each cycle drafted
            row["tested_total"] = row["accepted_total"] / alpha
        else:  # nothing accepted: each cycle that drafted tested one position (at most one per cycle)
            row["tested_total"] = float(sum(hist)) - _num(s["cycles_without_draft"])
        cycles = row["cycles"] if row["cycles"] == row["cycles"] else 0.0
        row["position_reached"] = [cycles] * len(row["position_acceptance"])
        row["position_accepted"] = [cycles * a for a in row["position_acceptance"]]
    row["setup"] = describe(row, CONDITION_KEYS)
    return row


def _prompt_format(cfg: dict) -> str:
    """How a cell's prompts were encoded for the target, whatever the dataset: `prompts.template`
    (auto, chat, raw; `auto` and `chat` send the same text to a target with a chat template, but
    only the setting is recorded), and a pair's own `chat_template` (its hash) where one is set."""
    text = str(cfg["prompts"]["template"])  # shown as prompt_format=auto
    chat_template = cfg["pair"].get("chat_template")  # set by the pairs that need one
    if chat_template:
        text += f" + pair chat_template {hashlib.sha256(str(chat_template).encode()).hexdigest()[:6]}"
    return text


def prompt_row(cell: str, r: dict, dataset: str) -> dict:
    """One row of the prompts frame: a prompt record's counts and timings, keyed by its set and id."""
    spec, base = r["spec"], r["base"]
    row = {
        "cell": cell,
        "prompt_id": str(r["id"]),
        "prompt_key": f"{dataset}:{r['id']}",
        "category": r["category"],
        "prompt_tokens": r["prompt_tokens"],
    }
    row.update({f"spec_{f}": spec[f] for f in SPEC_FIELDS})
    row.update(base_new_tokens=base["new_tokens"], base_time_s=base["time_s"])
    if "batch" in r:  # batch_size > 1: the batch's time, apportioned to its prompts by the tokens each committed
        unit = r["batch"]
        row["spec_time_s"] = unit["spec"]["time_s"] * spec["new_tokens"] / unit["spec"]["new_tokens"]
        row["base_time_s"] = unit["base"]["time_s"] * base["new_tokens"] / unit["base"]["new_tokens"]
    row["speedup"] = (spec["new_tokens"] / row["spec_time_s"]) / (base["new_tokens"] / row["base_time_s"])
    return row


def _resolved_dtype(dtype: Any, conditions: dict) -> str | None:
    """A model's dtype setting as the harness resolves it (harness.models.loading.resolve_dtype): auto is
    bfloat16 on CUDA, float32 elsewhere; None when the model has no dtype of its own."""
    if dtype in (None, ""):
        return None
    if dtype == "auto":
        return "bfloat16" if str(conditions["device"]).startswith("cuda") else "float32"
    return str(dtype)


def _sum_lists(lists: Iterable[list]) -> list[float]:
    total: list[float] = []
    for values in lists:
        for i, v in enumerate(values):
            if i == len(total):
                total.append(0.0)
            total[i] += v
    return total


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")
