"""Hydra callbacks: the table over the cells of a multirun.

Each job writes `cell.json` into its Hydra output directory (`record_job`,
called by harness.cli.main): its overrides, status and results directory. The
callback finds this sweep's cells from those pointers, not by listing the
results store, so cells of other sweeps sharing the store stay out and cells
this sweep skipped as already complete stay in. Pointers an earlier multirun
left in the same sweep directory are removed when the multirun starts. After each job it rewrites
aggregate.csv and aggregate.md in the sweep directory (an interrupted sweep
still has its table); at the end of the multirun it prints the table, and
exits 1 if a cell failed.

Registered in conf/config.yaml under `hydra.callbacks`, or for one command:
  +hydra.callbacks.aggregate._target_=harness.cli.callbacks.AggregateCallback
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.base.files import write_text_atomic
from harness.cli.summary import fmt

POINTER = "cell.json"

# (csv column, markdown header or None for csv only, markdown format)
COLUMNS = [
    ("job", "job", ""),
    ("pair", "pair", ""),
    ("k", "k", ""),
    ("batch_size", "B", ""),
    ("compile", "compile", ""),
    ("temperature", "T", ""),
    ("dataset", "dataset", ""),
    ("num_prompts", "prompts", ""),
    ("acceptance_rate", "accept ↑", ".3f"),
    ("tokens_per_cycle", "tok/cycle ↑", ".2f"),
    ("speedup", "speedup ↑", ".3f"),
    ("speedup_ci_low", None, ""),
    ("speedup_ci_high", None, ""),
    ("speedup_ci", "95% CI", ""),
    ("predicted_speedup", "predicted", ".3f"),
    ("efficiency", "efficiency", ".2f"),
    ("cost_ratio", "c ↓", ".3f"),
    ("target_step_ms", "target ms", ".2f"),
    ("limit_ratio", "limit", ".2f"),
    ("spec_tpot_ms", "TPOT ms ↓", ".2f"),
    ("base_tpot_ms", "base TPOT ms", ".2f"),
    ("status", "status", ""),
    ("cost_only", None, ""),
    ("cell", None, ""),
    ("cell_dir", None, ""),
    ("overrides", None, ""),
    ("error", None, ""),
]


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def record_job(summary: dict | None = None, error: str | None = None, status: str | None = None) -> None:
    """Write this Hydra job's pointer to its cell (no-op outside Hydra). `summary` needs only
    `cell` and `cell_dir`; `status`: finished, or failed when there is an error, unless given."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    pointer = {
        "job": OmegaConf.select(hydra_cfg, "job.num", default=None),
        "overrides": list(hydra_cfg.overrides.task),
        "status": status or ("failed" if error else "finished"),
        "error": error,
        "cell": (summary or {}).get("cell"),
        # Absolute, since out_dir is relative to where the job ran and the report may run from anywhere; and
        # as given, for an experiment folder moved or copied since (analysis.load tries both).
        "cell_dir": str(Path(summary["cell_dir"]).resolve()) if (summary or {}).get("cell_dir") else None,
        "cell_dir_given": (summary or {}).get("cell_dir"),
        "sweep_dir": (
            str(Path(str(hydra_cfg.sweep.dir)).resolve())
            if OmegaConf.select(hydra_cfg, "mode", default=None) == RunMode.MULTIRUN
            else None
        ),
    }
    write_text_atomic(Path(hydra_cfg.runtime.output_dir) / POINTER, json.dumps(pointer, indent=2) + "\n")


def _pointers(sweep_dir: str | Path) -> list[tuple[Path, dict]]:
    """This sweep folder's job pointers, not those of another sweep stored beneath it (hydra.sweep.dir=exp
    after hydra.sweep.dir=exp/first): those in a job folder right under it (hydra.sweep.subdir, the job
    number), which holds for a sweep folder copied, moved or reached by another path; and, deeper (a
    subdir with slashes), those that name this folder as their sweep's."""
    sweep_dir, own = Path(sweep_dir), []
    for path in sweep_dir.rglob(POINTER):
        try:
            pointer = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if path.parent.parent == sweep_dir or _same_folder(pointer.get("sweep_dir"), sweep_dir):
            own.append((path, pointer))
    return own


def _same_folder(named: str | None, folder: Path) -> bool:
    try:
        return named is not None and os.path.samefile(named, folder)
    except OSError:
        return False


def collect(sweep_dir: str | Path) -> list[dict]:
    """One row per job of the sweep that recorded a pointer, in job order."""
    rows = [_row(pointer) for _, pointer in _pointers(sweep_dir)]
    return sorted(rows, key=lambda r: (r["job"] is None, r["job"] if r["job"] is not None else 0, r["cell"] or ""))


def _row(pointer: dict) -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name, _, _ in COLUMNS}
    row.update(
        job=pointer.get("job"),
        status=pointer["status"],
        cell=pointer.get("cell"),
        cell_dir=pointer.get("cell_dir"),
        overrides=" ".join(pointer.get("overrides") or []),
        error=pointer.get("error"),
    )
    cell_dir = Path(pointer["cell_dir"]) if pointer.get("cell_dir") else None
    if cell_dir is None or not (cell_dir / "summary.json").exists():
        if row["status"] == "finished":
            row["status"] = "missing"  # the results store moved or was cleaned
        return row
    s = json.loads((cell_dir / "summary.json").read_text())
    for key in (
        "pair",
        "k",
        "temperature",
        "num_prompts",
        "acceptance_rate",
        "tokens_per_cycle",
        "speedup",
        "predicted_speedup",
        "efficiency",
        "cost_ratio",
        "limit_ratio",
    ):
        row[key] = s.get(key)
    row["speedup_ci_low"], row["speedup_ci_high"] = s["speedup_ci"]
    row["spec_tpot_ms"], row["base_tpot_ms"] = 1e3 * s["spec_tpot_s"], 1e3 * s["base_tpot_s"]
    row["target_step_ms"] = 1e3 * s["target_step_s"] if s.get("target_step_s") is not None else None
    config = OmegaConf.load(cell_dir / "config.yaml") if (cell_dir / "config.yaml").exists() else OmegaConf.create()
    row["dataset"] = s.get("dataset") or OmegaConf.select(config, "dataset.name", default=None)
    row["batch_size"] = OmegaConf.select(config, "batch_size", default=1)
    row["compile"] = OmegaConf.select(config, "compile", default=None)
    if s.get("cost_only"):  # random weights: what depends on acceptance is no result, the costs are
        for key in (
            "acceptance_rate",
            "tokens_per_cycle",
            "speedup",
            "speedup_ci_low",
            "speedup_ci_high",
            "predicted_speedup",
            "efficiency",
        ):
            row[key] = None
        row["spec_tpot_ms"] = None
        row["cost_only"] = True
    return row


def to_markdown(rows: list[dict]) -> str:
    shown = [(name, header, spec) for name, header, spec in COLUMNS if header]
    shared = set.intersection(*(set((r.get("overrides") or "").split()) for r in rows)) if len(rows) > 1 else set()
    lines = ["| " + " | ".join(h for _, h, _ in shown) + " |", "|" + "|".join("---" for _ in shown) + "|"]
    for row in rows:
        cells = []
        for name, _, spec in shown:
            if name == "speedup_ci":
                low, high = row["speedup_ci_low"], row["speedup_ci_high"]
                cells.append(f"[{fmt(low, missing='')}, {fmt(high, missing='')}]" if low is not None else "")
            elif name == "speedup" and row.get("cost_only"):
                cells.append("cost-only")
            elif name == "status" and row["status"] != "finished":  # which cell: a failed one has no pair or k
                own = [o for o in (row.get("overrides") or "").split() if o not in shared]  # what tells this job apart
                cells.append(f"{row['status']} ({' '.join(own)})" if own else row["status"])
            else:
                cells.append(fmt(row[name], spec, missing=""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    names = [name for name, _, _ in COLUMNS if name != "speedup_ci"]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=names, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_aggregate(sweep_dir: str | Path) -> tuple[list[dict], str]:
    """Collect the sweep's cells and write aggregate.csv and aggregate.md; returns (rows, markdown).
    No rows, no files: a multirun without benchmark jobs (python -m harness.exactness -m)."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    if not rows:
        return rows, ""
    table = to_markdown(rows)
    write_text_atomic(sweep_dir / "aggregate.csv", to_csv(rows))
    write_text_atomic(sweep_dir / "aggregate.md", table + "\n")
    return rows, table


def clear_pointers(sweep_dir: str | Path) -> None:
    """Remove the job pointers an earlier multirun left in a reused sweep directory
    (hydra.sweep.dir=multirun/exp), so that only this multirun's jobs are collected."""
    for path, _ in _pointers(sweep_dir):
        path.unlink(missing_ok=True)


class AggregateCallback(Callback):
    """Print and save the table over the cells of a multirun."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        clear_pointers(config.hydra.sweep.dir)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        output_dir = Path(config.hydra.runtime.output_dir)
        if job_return.status == JobStatus.FAILED and not (output_dir / POINTER).exists():
            error = getattr(job_return, "_return_value", None)  # an exception other than HarnessError
            pointer = {
                "job": config.hydra.job.num,
                "overrides": list(config.hydra.overrides.task),
                "status": "failed",
                "error": f"{type(error).__name__}: {error}",
                "cell": None,
                "cell_dir": None,
                "sweep_dir": str(Path(str(config.hydra.sweep.dir)).resolve()),
            }
            write_text_atomic(output_dir / POINTER, json.dumps(pointer, indent=2) + "\n")
        write_aggregate(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        rows, table = write_aggregate(sweep_dir)
        if not rows:  # no benchmark job recorded a cell
            return
        print(f"\n{len(rows)} cells in {sweep_dir}\n{table}\nsaved: {sweep_dir / 'aggregate.csv'}, {sweep_dir / 'aggregate.md'}")
        failed = [r for r in rows if r["status"] != "finished"]
        if failed:
            print(
                f"error: {len(failed)} of {len(rows)} cells did not finish (status column of {sweep_dir / 'aggregate.md'})",
                file=sys.stderr,
            )
            sys.exit(1)
