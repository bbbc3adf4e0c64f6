"""One loader for every kind of results: a local tree or a W&B sweep -> two frames.

A *cell* is one benchmark run (a pair, a k, a sampling setting, a prompt
set): `harness.runner.cell.run_cell` writes it as `<cell dir>/{config.yaml,
summary.json, prompts.jsonl}`, and `harness.tracking.tracker` logs the same three
things to one W&B run (config = resolved config, summary = summary.json,
the files as a "cell-results" artifact). Both sources are reduced to the
same raw triple (config, summary, records) and go through `frames`, so
every later step sees one schema:

  cells    one row per cell: identity (target, draft, label, dataset, k,
           sampling), the summary metrics, the measured costs, the draft size
  prompts  one row per cell x prompt: the counts and timings of both paths

A local source may be a cell directory, a results store (`out_dir`), a Hydra
run or multirun directory (its jobs' `cell.json` point at their cells) or a
mix; cells are found by their `summary.json` (written only when a cell
finishes) and deduplicated by (cell key, device name): results from before
the cell key hashed the resolved device share one key for a CPU
and a GPU run of the same config, and both are kept. Unfinished or failed cells
are left out and listed in `Results.notes`.

Each cell's run conditions (CONDITION_KEYS: the device name, dtype,
max_new_tokens, KV cache, compile, prompt format) are also joined into one `setup` string;
a decision or a fit never mixes two setups. A condition that older results
do not record is "unknown" (one setup).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from omegaconf import OmegaConf

from analysis.sizes import draft_size
from harness.errors import HarnessError

# entity/project or entity/project/sweep_id (also .../sweeps/<id>, as in a W&B URL)
WANDB_PATH = re.compile(r"^(?:wandb:)?([\w.-]+)/([\w.-]+)(?:/(?:sweeps/)?([\w-]+))?/?$")

# Summary scalars copied into the cells frame as they are.
SUMMARY_SCALARS = (
    "num_prompts", "alpha", "acceptance_rate", "expected_alpha", "tokens_per_cycle", "theoretical_tokens_per_cycle",
    "accepted_per_cycle", "speedup", "speedup_geomean", "decode_speedup", "predicted_speedup", "efficiency", "cost_ratio",
    "verify_cost", "cycles", "new_tokens", "base_new_tokens", "spec_time_s", "base_time_s", "spec_tpot_s",
    "base_tpot_s", "spec_ttft_s", "base_ttft_s", "max_new_tokens", "peak_rss_mb",
)
# Per-prompt fields of the speculative path kept in the prompts frame.
SPEC_FIELDS = ("cycles", "committed", "drafted", "accepted", "tested", "new_tokens", "time_s")
# The run conditions that change what a speedup means: a decision or a fit holds one value of each.
CONDITION_KEYS = ("device_name", "dtype", "max_new_tokens", "cache", "compile", "forward", "prompt_format")
# Dataset settings that decide which text a prompt id names (not which ids run: num_prompts,
# max_rows): cells of one dataset name that differ in one are different prompt sets.
TEXT_FIELDS = ("source", "text_field", "template", "id_field")  # source: the file, or the hub set and split
# W&B job types of the harness's runs that are not benchmark cells.
NOT_CELLS = ("exactness", "report")
# A cell's own speedup interval (summary.json's speedup_ci): harness.core.metrics computes it at 95%.
CELL_CONFIDENCE = 0.95
# A path that reads as a local one: starts with . / ~, or has a Hydra date or time segment.
LOCAL_LOOKING = re.compile(r"^[./~]|(^|/)(\d{4}-\d{2}-\d{2}|\d{2}-\d{2}-\d{2}(\.\d{6})?)(/|$)")


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


def load(source: str | Path, api: Any = None) -> Results:
    """Load a local results directory or a W&B path (entity/project[/sweep_id])."""
    path = Path(source).expanduser()
    if path.is_file():
        raise HarnessError(f"{source} is a file: give the folder that holds the cells (a cell's own folder, a results "
                           f"folder or a sweep folder)")
    if path.exists():
        return load_local(path)
    if _looks_local(str(source)):
        raise HarnessError(f"no such results directory: {source}")
    if WANDB_PATH.match(str(source)):
        return load_wandb(str(source), api)
    raise HarnessError(f"{source} is neither a results directory nor a W&B path (entity/project or entity/project/sweep_id)")


def _looks_local(source: str) -> bool:
    """A missing path the user meant as local (a typo), not a W&B entity/project[/sweep]."""
    if source.startswith("wandb:"):
        return False
    parent = Path(source).expanduser().parent
    return bool(LOCAL_LOOKING.search(source)) or (parent != Path(".") and parent.is_dir())


# Local trees


def load_local(root: Path) -> Results:
    dirs, notes = find_cell_dirs(root)
    raws = []
    for cell_dir in dirs:
        summary = json.loads((cell_dir / "summary.json").read_text())
        config_path = cell_dir / "config.yaml"
        config = OmegaConf.to_container(OmegaConf.load(config_path)) if config_path.exists() else {}
        raws.append(RawCell(config, summary, read_records(cell_dir / "prompts.jsonl"), str(cell_dir)))
    results = frames(raws, str(root), "local", notes)
    if results.cells.empty:
        raise HarnessError(f"no finished cell under {root} (a cell is a directory with summary.json, written when it finishes)")
    return results


def _pointed_dir(pointer_path: Path, pointer: dict) -> Path:
    """A pointer's cell folder, the first of these that holds a summary.json: its absolute path, the
    path the job was given (older pointers hold only that) relative to the folder the job ran in
    (hydra.runtime.cwd in the job's .hydra/hydra.yaml), then relative to the folders above the pointer,
    then to the current folder. For a job folder no longer where it ran (hydra.runtime.output_dir: an
    experiment moved or copied since), the folders above the pointer come first: the original place
    may hold another run's cell by now."""
    cell_dir, given = Path(pointer["cell_dir"]), Path(pointer.get("cell_dir_given") or pointer["cell_dir"])
    try:
        runtime = yaml.safe_load((pointer_path.parent / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]
        cwd, ran_in = runtime.get("cwd"), runtime.get("output_dir")
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        cwd = ran_in = None
    # Moved or copied: the job's folder is no longer where it ran, and the original may still hold another run's cell.
    moved = ran_in is not None and Path(ran_in).resolve() != pointer_path.parent.resolve()
    here = [folder / given for folder in pointer_path.parents] if not given.is_absolute() else []
    there = ([cell_dir] if cell_dir.is_absolute() else []) + ([Path(cwd) / given] if cwd and not given.is_absolute() else [])
    options = (here + there if moved else there + here) + ([given] if not given.is_absolute() else [])
    return next((p for p in options if (p / "summary.json").exists()), options[0] if options else given)


def find_cell_dirs(root: Path) -> tuple[list[Path], list[str]]:
    """Finished cell directories under `root` or pointed at by Hydra jobs in it, and notes on the rest."""
    notes: list[str] = []
    found = [p.parent for p in sorted(root.rglob("summary.json"))]
    for pointer_path in sorted(root.rglob("cell.json")):  # Hydra jobs (harness.cli.callbacks.record_job)
        try:
            pointer = json.loads(pointer_path.read_text())
        except (OSError, ValueError):
            continue
        if pointer.get("cell_dir"):
            pointer["cell_dir"] = str(_pointed_dir(pointer_path, pointer))
        done_since = bool(pointer.get("cell_dir")) and (Path(pointer["cell_dir"]) / "summary.json").exists()  # a job resumed since
        if pointer.get("status") != "finished" and not done_since or not pointer.get("cell_dir"):
            overrides = " ".join(pointer.get("overrides") or [])
            notes.append(f"job {pointer.get('job')} ({overrides}) {pointer.get('status')}: {pointer.get('error')}")
            continue
        cell_dir = Path(pointer["cell_dir"])
        if (cell_dir / "summary.json").exists():
            if cell_dir not in found:
                found.append(cell_dir)
        else:
            notes.append(f"job {pointer.get('job')} points at {cell_dir}, which has no summary.json (moved or cleaned?)")
    for status_path in sorted(root.rglob("status.json")):
        if not (status_path.parent / "summary.json").exists():
            try:
                status = json.loads(status_path.read_text())
            except (OSError, ValueError):
                status = {}
            notes.append(f"cell {status_path.parent.name} not finished ({status.get('status')}, "
                         f"{status.get('done')}/{status.get('total')} prompts): left out")
    unique = list(dict.fromkeys(p.resolve() for p in found))
    for p in unique:
        if not _is_cell(p):  # a summary.json cut short (a full disk, a copy interrupted) or not the harness's
            notes.append(f"cell {p.name}: its summary.json is not a finished cell's (unreadable, or without k and costs): left out")
            print(f"warning: {notes[-1]}", file=sys.stderr)
    return [p for p in unique if _is_cell(p)], notes


def _is_cell(path: Path) -> bool:
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and "k" in summary and "costs" in summary


def read_records(path: Path) -> list[dict] | None:
    if not path.exists():
        return None
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by an interruption
    return records


# W&B


def load_wandb(path: str, api: Any = None) -> Results:
    """Every finished benchmark run of a W&B sweep (entity/project/sweep_id) or project (entity/project).

    Per-prompt rows come from the run's "cell-results" artifact; a run without
    one contributes its cell row only (and is left out of the paired decision).
    """
    entity, project, sweep_id = WANDB_PATH.match(path).groups()
    if api is None:
        import wandb

        try:
            api = wandb.Api(timeout=60)
        except Exception as err:  # noqa: BLE001 - no key, no network
            raise HarnessError(f"cannot reach W&B for {path} ({type(err).__name__}: {str(err).splitlines()[0]}); "
                               f"log in (wandb login, or WANDB_API_KEY) or give a local results directory") from None
    try:
        runs = list(api.sweep(f"{entity}/{project}/{sweep_id}").runs if sweep_id else api.runs(f"{entity}/{project}"))
    except Exception as err:  # noqa: BLE001
        raise HarnessError(f"cannot read W&B {path}: {type(err).__name__}: {err}".splitlines()[0]) from None
    raws, notes, bare, unfinished = [], [], [], []
    for run in runs:
        config = _unshadow({k: v for k, v in dict(run.config).items() if not k.startswith("_")})
        summary = _summary_dict(run)
        if "pair" not in config or "k" not in config or getattr(run, "job_type", None) in NOT_CELLS:
            continue  # not a benchmark cell: a report run, an exactness check
        if summary.get("status") != "finished":  # a failed cell's summary may hold no metric at all
            unfinished.append((getattr(run, "name", ""), f"run {run.id} ({getattr(run, 'name', '')}) is "
                                                          f"{summary.get('status') or run.state}: left out"))
            continue
        if "k" not in summary or "costs" not in summary:
            continue  # finished but not a benchmark cell (an exactness check logged without its job type)
        records = _artifact_records(run)
        if records is None:
            bare.append(run.id)
        raws.append(RawCell(config, summary, records, f"wandb:{entity}/{project}/{run.id}"))
    if bare:
        notes.append(f"{len(bare)} runs have no cell-results artifact ({', '.join(bare[:5])}{', ...' if len(bare) > 5 else ''}): "
                     f"cell-level rows only, decided from their summaries (unpaired)")
    results = frames(raws, path, "wandb", notes)
    # A run is named by its cell key (harness.tracking.tracker): an unfinished run whose cell another run finished is not a gap.
    loaded = {str(cell).split("@")[0] for cell in results.cells.get("cell", [])}
    results.notes = [note for name, note in unfinished if name not in loaded] + results.notes
    if results.cells.empty:
        raise HarnessError(f"no finished benchmark run in W&B {path}")
    return results


def _unshadow(config: dict) -> dict:
    """Under `wandb agent` a swept config group (dataset=gsm8k) shows as its option's name, and
    harness.tracking.tracker keeps the group's resolved fields as `<group>_config`: put them back."""
    for key, value in list(config.items()):
        fields = config.get(f"{key}_config")
        if not isinstance(value, dict) and isinstance(fields, dict):
            config[key] = fields
    return config


def _summary_dict(run) -> dict:
    summary = getattr(run, "summary_metrics", None)  # a plain dict in the public API
    if summary is None:
        summary = getattr(run.summary, "_json_dict", None) or dict(run.summary)
    return dict(summary)


def _artifact_records(run) -> list[dict] | None:
    try:
        artifacts = [a for a in run.logged_artifacts() if a.type == "cell-results"]
        if not artifacts:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(artifacts[-1].download(root=tmp))
            return read_records(root / "prompts.jsonl")
    except Exception as err:  # noqa: BLE001 - a missing artifact degrades to cell-level rows
        print(f"warning: W&B run {run.id}: could not read its artifact ({type(err).__name__}: {err})", file=sys.stderr)
        return None


# The one schema


def frames(raws: Iterable[RawCell], source: str, kind: str, notes: list[str] | None = None) -> Results:
    """The cells and prompts frames of raw cells (duplicates of a cell key on one device are dropped).

    One cell key on several devices (the same config run on two machines) keeps a row per device,
    its `cell` qualified by the device name so that every row's `cell` is unique."""
    notes = list(notes or [])
    kept, seen = [], {}  # (cell, device) -> the first raw cell of it
    for raw in raws:
        row = cell_row(raw)
        key = (row["cell"], row["device_name"])
        if key in seen:
            if not (raw.summary.get("reused") or seen[key].summary.get("reused")):  # a sweep's run of a complete cell logs it again
                notes.append(f"cell {row['cell']} on {row['device_name']} found twice ({seen[key].origin}, {raw.origin}): the first is used")
            continue
        seen[key] = raw
        kept.append((row, raw.records))
    _dataset_names([row for row, _ in kept])
    devices = Counter(row["cell"] for row, _ in kept)
    cell_rows, prompt_rows = [], []
    for row, records in kept:
        if devices[row["cell"]] > 1:
            row["cell"] = f"{row['cell']}@{row['device_name']}"
        cell_rows.append(row)
        for r in records or []:
            prompt_rows.append(prompt_row(row["cell"], r, row["dataset"]))
    cells = pd.DataFrame(cell_rows)
    if cells.empty:
        return Results(cells, pd.DataFrame(), source, kind, notes)
    cells["label"] = _labels(cells)
    cells = cells.sort_values(["target", "setup", "label", "dataset", "sampling", "k"], kind="stable").reset_index(drop=True)
    prompts = pd.DataFrame(prompt_rows)
    if not prompts.empty:
        keys = cells[["cell", "target", "setup", "label", "draft_kind", "dataset", "sampling", "temperature", "k"]]
        prompts = prompts.merge(keys, on="cell", how="left")
    return Results(cells, prompts, source, kind, notes)


def cell_row(raw: RawCell) -> dict:
    s, cfg = raw.summary, raw.config
    pair = cfg.get("pair") or {}
    draft = pair.get("draft") or {}
    costs = s.get("costs") or {}
    conditions = s.get("conditions") or cfg.get("conditions") or {}
    kind = draft.get("kind", "model")
    dataset = cfg["dataset"] if isinstance(cfg.get("dataset"), dict) else {}
    if kind == "ngram":
        length = draft.get("length", "match")
        draft_id = f"ngram({draft.get('min_ngram', 1)}-{draft.get('max_ngram', 3)})" + ("" if length == "match" else f"-{length}")
    else:
        draft_id = str(s.get("draft") or draft.get("id")).rstrip("/") or "/"  # a folder named with or without its slash: one draft
        dtype = _resolved_dtype(draft.get("dtype"), conditions)
        variant = _variant(draft) + (f"[{dtype}]" if dtype and conditions.get("dtype") and dtype != conditions["dtype"] else "")
        draft_id += variant  # a draft in another dtype than its target is another draft
    temperature = float(s.get("temperature", cfg.get("temperature", 0.0)))
    top_k, top_p = int(s.get("top_k", cfg.get("top_k", 0)) or 0), float(s.get("top_p", cfg.get("top_p", 1.0)) or 1.0)
    ci = s.get("speedup_ci") or [s.get("speedup_ci_low", np.nan), s.get("speedup_ci_high", np.nan)]
    gci = s.get("speedup_geomean_ci") or [np.nan, np.nan]
    hist = list(s.get("accept_hist") or [])
    row = {
        "cell": s.get("cell") or Path(raw.origin).name,
        "origin": raw.origin,
        "pair": s.get("pair") or pair.get("name"),
        "target": (str(s.get("target") or (pair.get("target") or {}).get("id")).rstrip("/") or "/") + _variant(pair.get("target") or {}),
        "draft": draft_id,
        "draft_variant": variant if kind != "ngram" else "",  # the end of `draft` that is no part of its path
        "draft_kind": kind,
        "dataset": str(dataset.get("name") or (s["dataset"] if isinstance(s.get("dataset"), str) else "unknown")),
        "dataset_file": dataset.get("path"),  # _dataset_names reads these two, then drops them
        "dataset_sha256": s.get("dataset_sha256"),
        "dataset_text": _text_settings(dataset),
        "k": int(s["k"]),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "sampling": sampling_name(temperature, top_k, top_p),
        "seed": cfg.get("seed"),
        # Which prompts the cell ran (None when the summary does not say): cells compared on summaries alone must match.
        "prompt_set": hashlib.sha256(json.dumps(sorted(map(str, s["prompt_ids"]))).encode()).hexdigest()[:12]
        if isinstance(s.get("prompt_ids"), list) else None,
        **{key: _num(s.get(key)) for key in SUMMARY_SCALARS},
        "speedup_ci_low": _num(ci[0]), "speedup_ci_high": _num(ci[1]),
        "speedup_geomean_ci_low": _num(gci[0]), "speedup_geomean_ci_high": _num(gci[1]),
        "target_step_s": _num(costs.get("target_step_s")),
        "draft_step_s": _num(costs.get("draft_step_s")),
        "verify_costs": list(costs.get("verify_cost") or []),  # v(n) for n = 1..k+1
        "position_acceptance": [_num(a) for a in s.get("position_acceptance") or []],
        "accept_hist": hist,
        # Without per-prompt rows (a W&B run without its artifact): accepted drafts are exact from the
        # histogram, tested positions from alpha = accepted / tested (below).
        "accepted_total": float(sum(j * n for j, n in enumerate(hist))),
        "tested_total": np.nan,
        "device": conditions.get("device"),
        # The run conditions (CONDITION_KEYS); the harness records cache and compile in the config.
        "device_name": _device_label(conditions),
        "dtype": _known(conditions.get("dtype")),
        "cache": _known(conditions.get("cache", cfg.get("cache"))),
        "compile": _known(conditions.get("compile", cfg.get("compile"))),
        "forward": _known(conditions.get("forward", cfg.get("forward", "hf"))),  # cells from before forward=lean: HF's
        "prompt_format": _prompt_format(cfg),
        "has_prompts": raw.records is not None and len(raw.records) > 0,
    }
    if raw.records:  # exact counts
        row["accepted_total"] = float(sum(r["spec"]["accepted"] for r in raw.records))
        row["tested_total"] = float(sum(r["spec"]["tested"] for r in raw.records))
        reached = _sum_lists(r["spec"]["position_reached"] for r in raw.records)
        kept = _sum_lists(r["spec"]["position_accepted"] for r in raw.records)
        row["position_reached"], row["position_accepted"] = reached, kept
    else:  # only the ratios are known; weight positions by cycles
        alpha = row["alpha"]
        if alpha == alpha and alpha > 0:  # tested = accepted / alpha, whatever each cycle drafted
            row["tested_total"] = row["accepted_total"] / alpha
        else:  # nothing accepted: each cycle that drafted tested one position (at most one per cycle)
            row["tested_total"] = float(sum(hist)) - _num(s.get("cycles_without_draft") or 0)
        cycles = row["cycles"] if row["cycles"] == row["cycles"] else 0.0
        row["position_reached"] = [cycles] * len(row["position_acceptance"])
        row["position_accepted"] = [cycles * a for a in row["position_acceptance"]]
    if row["max_new_tokens"] != row["max_new_tokens"]:
        row["max_new_tokens"] = _num(cfg.get("max_new_tokens"))
    row["setup"] = describe(row, CONDITION_KEYS)
    # The draft's bytes at the dtype it loaded in: its own setting, auto where it has none (harness.models.loading.ModelSpec).
    size = draft_size(kind, draft.get("id"), _resolved_dtype(draft.get("dtype") or "auto", conditions), s)
    row.update(draft_params=size["params"], draft_bytes=size["bytes"], draft_size_source=size["source"])
    return row


def _prompt_format(cfg: dict) -> str:
    """How a cell's prompts were encoded for the target, whatever the dataset: `prompts.template`
    (auto, chat, raw; `auto` and `chat` send the same text to a target with a chat template, but
    only the setting is recorded), and a pair's own `chat_template` (its hash) where one is set."""
    prompts = cfg.get("prompts") if isinstance(cfg.get("prompts"), dict) else {}
    pair = cfg.get("pair") if isinstance(cfg.get("pair"), dict) else {}
    text = _known(prompts.get("template"))  # shown as prompt_format=auto
    if pair.get("chat_template"):
        text += f" + pair chat_template {hashlib.sha256(str(pair['chat_template']).encode()).hexdigest()[:6]}"
    return text


def _dataset_names(rows: list[dict]) -> None:
    """Give each prompt set its own name, so that prompts of different sets never pair by id.

    A local file is `local:<file name>` (every local file runs as dataset `local`, and ids like
    local-0 recur from file to file). Where cells of one such name read files of different
    contents (the SHA-256 the summaries record, also of a hub set's local copy), each content
    gets its SHA's first 6 hex digits after the name, and cells that read a file but predate the
    SHA `#unknown`; with one content known they join it. Where cells of one name differ in a
    TEXT_FIELDS setting (another split or file, another template), the name gets the settings that differ, e.g.
    `gsm8k[source=openai/gsm8k:train]`; a cell whose config lacks a setting (older results, from
    before the dataset config had it) joins the group's one known value, or reads `unknown`."""
    for row in rows:
        if row["dataset"] == "local" and row["dataset_file"]:
            row["dataset"] = f"local:{Path(str(row['dataset_file'])).name}"
    contents: dict[str, set[str]] = {}
    for row in rows:
        if row["dataset_sha256"]:
            contents.setdefault(row["dataset"], set()).add(row["dataset_sha256"])
    for row in rows:
        if len(contents.get(row["dataset"], ())) > 1 and (row["dataset_sha256"] or row["dataset_file"]):  # hub reads: no file
            row["dataset"] += f"#{row['dataset_sha256'][:6]}" if row["dataset_sha256"] else "#unknown"
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["dataset"], []).append(row)
    for group in groups.values():
        differ = [f for f in TEXT_FIELDS if len({_short(r["dataset_text"][f]) for r in group if f in r["dataset_text"]}) > 1]
        for row in group:
            if differ:
                text = row["dataset_text"]
                row["dataset"] += "[" + ", ".join(f"{f}={_short(text[f]) if f in text else 'unknown'}" for f in differ) + "]"
    for row in rows:
        del row["dataset_file"], row["dataset_sha256"], row["dataset_text"]


def _text_settings(dataset: dict) -> dict:
    """The TEXT_FIELDS of a dataset config, absent ones left out (see _dataset_names). `source` is
    where the text comes from: the file's name where `path` is set (a hub set read from a local
    copy reads the file, whatever its hf_id and split say), else hf_id, hf_config and split."""
    settings = {f: dataset[f] for f in ("text_field", "template", "id_field") if f in dataset}
    if dataset.get("path"):
        settings["source"] = Path(str(dataset["path"])).name
    elif any(f in dataset for f in ("hf_id", "hf_config", "split")):
        settings["source"] = ":".join(str(dataset.get(f)) for f in ("hf_id", "hf_config", "split") if dataset.get(f) is not None)
        if dataset.get("revision"):  # a pinned revision is other rows, perhaps
            settings["source"] += f"@{dataset['revision']}"
    return settings


def _short(value: Any) -> str:
    """A setting as a name can show it: as it is when short and plain, else `sha-` and 6 hex digits."""
    text = "none" if value is None else str(value)
    return text if re.fullmatch(r"[\w./:-]{1,40}", text) else f"sha-{hashlib.sha256(text.encode()).hexdigest()[:6]}"


def prompt_row(cell: str, r: dict, dataset: str) -> dict:
    spec, base = r["spec"], r["base"]
    row = {"cell": cell, "prompt_id": str(r["id"]), "prompt_key": f"{dataset}:{r['id']}", "category": r.get("category") or "all",
           "prompt_tokens": r.get("prompt_tokens")}
    row.update({f"spec_{f}": spec[f] for f in SPEC_FIELDS})
    row.update(base_new_tokens=base["new_tokens"], base_time_s=base["time_s"])
    row["speedup"] = (spec["new_tokens"] / spec["time_s"]) / (base["new_tokens"] / base["time_s"])
    return row


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


def _variant(model: dict) -> str:
    """What makes another model of one id: '@v2' for a revision other than the hub's default branch,
    '[model-q4.gguf]' for a GGUF file of the repo."""
    revision, gguf = model.get("revision"), model.get("gguf_file")
    return ("" if revision in (None, "", "main") else f"@{revision}") + (f"[{gguf}]" if gguf else "")


def _resolved_dtype(dtype: Any, conditions: dict) -> str | None:
    """A model's dtype setting as the harness resolves it (harness.models.loading.resolve_dtype): auto is
    bfloat16 on CUDA, float32 elsewhere; None when the setting was not recorded."""
    if dtype in (None, ""):
        return None
    if dtype == "auto":
        return "bfloat16" if str(conditions.get("device", "")).startswith("cuda") else "float32"
    return str(dtype)


def _labels(cells: pd.DataFrame) -> pd.Series:
    """A short name per draft: the pair name, qualified when one pair name covers several drafts
    (by the shortest end of the drafts' ids that tells them apart: `pair/final` or `pair/a/final`;
    prompt lookup by its whole setting, `ngram(1-3)`), so that two drafts never share a label."""
    pairs = pd.Series([p if isinstance(p, str) else "unnamed" for p in cells["pair"]], index=cells.index)  # a missing name too
    variants = dict(zip(cells["draft"].astype(str), cells.get("draft_variant", pd.Series("", index=cells.index)).fillna("")))
    short: dict[tuple[str, str], str] = {}
    for pair, drafts in cells["draft"].groupby(pairs):
        ids = sorted(set(map(str, drafts)))
        if len(ids) == 1:
            short[(pair, ids[0])] = str(pair)
            continue
        # Split the path only: a revision like refs/pr/3 stays whole after it.
        parts = {d: d[:len(d) - len(variants.get(d, ""))].split("/") for d in ids}
        for depth in range(1, max(map(len, parts.values())) + 1):
            ends = {d: "/".join(p[-depth:]) + variants.get(d, "") for d, p in parts.items()}
            if len(set(ends.values())) == len(ids):
                break
        short.update({(pair, d): f"{pair}/{end}" for d, end in ends.items()})
    return pd.Series([short[(pair, str(draft))] for pair, draft in zip(pairs, cells["draft"])], index=cells.index)


def _device_label(conditions: dict) -> str:
    """The device as the harness keys cells by it: a GPU's model; a CPU's model and its
    torch threads (its timings depend on both), e.g. "AMD EPYC, 2 threads", and ", W @ x.T"
    when its linear layers took few rows that way (harness.models.cpu_linear; torch's product otherwise)."""
    name = _known(conditions.get("device_name") or conditions.get("device"))
    threads = conditions.get("threads")
    if str(conditions.get("device", "")).startswith("cpu") and threads:
        transposed = (conditions.get("linear") or {}).get("product") == "transposed"  # harness.models.cpu_linear's record
        return f"{name}, {threads} threads" + (", W @ x.T" if transposed else "")
    return name


def _known(value: Any) -> str:
    return "unknown" if value is None else str(value)


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
