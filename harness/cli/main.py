"""`python -m harness`: the Hydra entry point, thin over harness.runner.cell.run_cell.

In a multirun (-m) a cell that fails (a HarnessError, out of memory, any
runtime error) is recorded as failed and the sweep goes on;
harness.cli.callbacks.AggregateCallback lists it and exits 1. Ctrl-C or SIGTERM
leaves the finished prompts on disk and exits 130; re-running resumes.
"""

import json
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from harness.cli.callbacks import in_multirun, record_job, write_aggregate
from harness.cli.summary import format_summary
from harness.config.checks import CONF_DIR, validate, with_default_pair
from harness.errors import HarnessError


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        validate(with_default_pair(cfg))  # a setting refused: one line in a second, before torch and transformers load
        from transformers.utils import logging as hf_logging

        from harness.runner.cell import run_cell

        hf_logging.disable_progress_bar()  # loading bars would bury the table; tqdm over prompts stays
        summary = run_cell(cfg)
    except KeyboardInterrupt:
        again = (
            "run it again with force=false to resume (force=true starts the cell over)"
            if cfg.get("force") is True
            else "run the same command again to resume"
        )
        print(f"interrupted: finished prompts are saved; {again}", file=sys.stderr)
        record_job(_cell_of(cfg), error="interrupted", status="interrupted")
        if in_multirun():  # Hydra's on_job_end does not run after an interrupt: list the sweep's jobs so far now
            write_aggregate(HydraConfig.get().sweep.dir)
        sys.exit(130)
    except Exception as err:
        if not isinstance(err, HarnessError) and not _out_of_memory(err):
            return _crashed(cfg, err)
        message = str(err).splitlines()[0] if isinstance(err, HarnessError) else f"out of memory: {str(err).splitlines()[0]}"
        print(f"error: {message}", file=sys.stderr)
        record_job(error=message)
        _record_failure(cfg, message)
        exit_code = getattr(err, "exit_code", 1)
        del err
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
            sys.modules["torch"].cuda.empty_cache()  # give the next cell of a sweep the memory this one held
        if in_multirun():
            return float("nan")
        sys.exit(exit_code)
    record_job(summary)
    print(format_summary(summary))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("categories", "prompt_ids")}))
    return summary["speedup"]


def _out_of_memory(err: Exception) -> bool:
    """torch's out-of-memory error (torch is loaded by then: nothing before it can run out of device memory)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(err, torch.OutOfMemoryError)


def _crashed(cfg: DictConfig, err: Exception) -> float:
    """A cell that failed for another reason: a bug, not a user mistake, keeps its traceback; in a
    multirun, one failing cell (a model that will not load, a runtime error) must not end the sweep."""
    _record_failure(cfg, f"{type(err).__name__}: {err}")
    if not in_multirun():
        raise err
    print(f"error: cell failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
    record_job(error=f"{type(err).__name__}: {err}")
    return float("nan")


def _cell_of(cfg: DictConfig) -> dict:
    """The cell a job was running (its key and directory), for its pointer; {} if it cannot be named."""
    from harness.runner.store import cell_path

    try:
        path = cell_path(with_default_pair(cfg))
    except Exception:  # a config that did not get as far as a cell
        return {}
    return {"cell": path.name, "cell_dir": str(path)}


def _record_failure(cfg: DictConfig, error: str) -> None:
    """Under `wandb agent`, a W&B run that says why the cell failed, if it failed before opening one."""
    if not os.environ.get(
        "WANDB_SWEEP_ID"
    ):  # tracking.record_failure's own test, made before the cell (harness.runner.cell) is named
        return
    import harness.tracking.tracker as tracking

    try:
        cfg = with_default_pair(cfg)
    except Exception:  # the pair is what failed: the run gets the config as given
        pass
    cell_dir = _cell_of(cfg).get("cell_dir") or Path(str(cfg.get("out_dir") or "results")) / "failed-cell"
    tracking.record_failure(cfg, cell_dir, error.splitlines()[0] if error else error)


def cli() -> None:
    """`python -m harness`: Hydra composes the command line's config once before `main` runs, so that a
    setting it refuses is one line (harness.config.checks.check_choices), not Hydra's traceback."""
    from harness.config.checks import check_choices

    check_choices(sys.argv[1:])
    main()
