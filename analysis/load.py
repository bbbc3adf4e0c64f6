"""One loader for every kind of results: a local tree or a W&B sweep -> two frames.

`harness.runner.cell.run_cell` writes a cell as `<cell dir>/{config.yaml,
summary.json, prompts.jsonl}`, and `harness.tracking.tracker` logs the same
three things to one W&B run (config = resolved config, summary =
summary.json, the files as a "cell-results" artifact). Both sources are
reduced to the same raw triple (analysis.frames.RawCell) and go through
`analysis.frames.frames`, so every later step sees one schema.

A local source may be a cell directory, a results store (`out_dir`), a Hydra
run or multirun directory (its jobs' `cell.json` point at their cells) or a
mix; cells are found by their `summary.json` (written only when a cell
finishes). Unfinished or failed cells are left out and listed in
`Results.notes`. A summary of another layout than this analysis reads (its
`schema_version`, harness.runner.store.SCHEMA_VERSION) is refused in one line.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from analysis.frames import RawCell, Results, frames
from harness.errors import HarnessError, one_line
from harness.runner.store import SCHEMA_VERSION

# entity/project or entity/project/sweep_id (also .../sweeps/<id>, as in a W&B URL)
WANDB_PATH = re.compile(r"^(?:wandb:)?([\w.-]+)/([\w.-]+)(?:/(?:sweeps/)?([\w-]+))?/?$")
# W&B job types of the harness's runs that are not benchmark cells.
NOT_CELLS = ("exactness", "report")
# A path that reads as a local one: starts with . / ~, or has a Hydra date or time segment.
LOCAL_LOOKING = re.compile(r"^[./~]|(^|/)(\d{4}-\d{2}-\d{2}|\d{2}-\d{2}-\d{2}(\.\d{6})?)(/|$)")


def load(source: str | Path, api: Any = None) -> Results:
    """Load a local results directory or a W&B path (entity/project[/sweep_id])."""
    path = Path(source).expanduser()
    if path.is_file():
        raise HarnessError(
            f"{source} is a file: give the folder that holds the cells (a cell's own folder, a results folder or a sweep folder)"
        )
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


def check_schema(summary: dict, where: str | Path) -> None:
    """Refuse a cell whose summary is of another layout than this analysis reads: one line naming it."""
    version = summary.get("schema_version")
    if version != SCHEMA_VERSION:
        raise HarnessError(
            f"{where} was written by an incompatible harness version (schema {version}, this reads "
            f"{SCHEMA_VERSION}): re-run the cell with force=true"
        )


# Local trees


def load_local(root: Path) -> Results:
    dirs, notes = find_cell_dirs(root)
    raws = []
    for cell_dir in dirs:
        summary_path, config_path = cell_dir / "summary.json", cell_dir / "config.yaml"
        summary = json.loads(summary_path.read_text())
        check_schema(summary, summary_path)
        if not config_path.exists():
            raise HarnessError(
                f"{cell_dir} has a summary.json but no config.yaml: copy the cell's folder whole, or re-run "
                f"the cell with force=true"
            )
        config = OmegaConf.to_container(OmegaConf.load(config_path))
        raws.append(RawCell(config, summary, read_records(cell_dir / "prompts.jsonl"), str(cell_dir)))
    results = frames(raws, str(root), "local", notes)
    if results.cells.empty and results.shapes.empty:
        raise HarnessError(f"no finished cell under {root} (a cell is a directory with summary.json, written when it finishes)")
    return results


def _pointed_dir(pointer_path: Path, pointer: dict) -> Path:
    """A pointer's cell folder, the first of these that holds a summary.json: its absolute path
    (`cell_dir`), then the path the job was given (`cell_dir_given`, e.g. results/<key> with
    out_dir=results) relative to the folders above the pointer, then to the current folder. For a
    job folder no longer where it ran (hydra.runtime.output_dir in the job's .hydra/hydra.yaml: an
    experiment moved or copied since), the folders above the pointer come first: the original place
    may hold another run's cell by now."""
    cell_dir, given = Path(pointer["cell_dir"]), pointer.get("cell_dir_given")
    try:
        ran_in = yaml.safe_load((pointer_path.parent / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"].get("output_dir")
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        ran_in = None
    moved = ran_in is not None and Path(ran_in).resolve() != pointer_path.parent.resolve()
    here = [] if given is None or Path(given).is_absolute() else [folder / given for folder in pointer_path.parents]
    options = (here + [cell_dir] if moved else [cell_dir] + here) + ([Path(given)] if here else [])
    return next((p for p in options if (p / "summary.json").exists()), cell_dir)


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
        done_since = (
            bool(pointer.get("cell_dir")) and (Path(pointer["cell_dir"]) / "summary.json").exists()
        )  # a job resumed since
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
            notes.append(
                f"cell {status_path.parent.name} not finished ({status.get('status')}, "
                f"{status.get('done')}/{status.get('total')} prompts): left out"
            )
    unique = list(dict.fromkeys(p.resolve() for p in found))
    for p in unique:
        if not _is_cell(p):  # a summary.json cut short (a full disk, a copy interrupted) or not the harness's
            notes.append(
                f"cell {p.name}: its summary.json is not a finished cell's (unreadable, or without k and costs): left out"
            )
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
            raise HarnessError(
                f"cannot reach W&B for {path} ({one_line(err, with_type=True)}); "
                f"log in (wandb login, or WANDB_API_KEY) or give a local results directory"
            ) from None
    try:
        runs = list(api.sweep(f"{entity}/{project}/{sweep_id}").runs if sweep_id else api.runs(f"{entity}/{project}"))
    except Exception as err:  # noqa: BLE001
        raise HarnessError(f"cannot read W&B {path}: {one_line(err, with_type=True)}") from None
    raws, notes, bare, unfinished = [], [], [], []
    for run in runs:
        config = _unshadow({k: v for k, v in dict(run.config).items() if not k.startswith("_")})
        summary = _summary_dict(run)
        if "pair" not in config or "k" not in config or getattr(run, "job_type", None) in NOT_CELLS:
            continue  # not a benchmark cell: a report run, an exactness check
        if summary.get("status") != "finished":  # a failed cell's summary may hold no metric at all
            unfinished.append(
                (
                    getattr(run, "name", ""),
                    f"run {run.id} ({getattr(run, 'name', '')}) is {summary.get('status') or run.state}: left out",
                )
            )
            continue
        if "k" not in summary or "costs" not in summary:
            continue  # finished but not a benchmark cell (an exactness check logged without its job type)
        check_schema(summary, f"W&B run {entity}/{project}/{run.id}")
        records = _artifact_records(run)
        if records is None:
            bare.append(run.id)
        raws.append(RawCell(config, summary, records, f"wandb:{entity}/{project}/{run.id}"))
    if bare:
        notes.append(
            f"{len(bare)} runs have no cell-results artifact ({', '.join(bare[:5])}{', ...' if len(bare) > 5 else ''}): "
            f"cell-level rows only, decided from their summaries (unpaired)"
        )
    results = frames(raws, path, "wandb", notes)
    # A run is named by its cell key (harness.tracking.tracker): an unfinished run whose cell another run finished is not a gap.
    loaded = {str(cell).split("@")[0] for cell in results.cells.get("cell", [])}
    results.notes = [note for name, note in unfinished if name not in loaded] + results.notes
    if results.cells.empty and results.shapes.empty:
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
