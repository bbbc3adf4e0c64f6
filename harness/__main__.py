"""`python -m harness`: the Hydra entry point, thin over harness.run.run_cell.

In a multirun (-m) a cell that fails (a HarnessError, out of memory, any
runtime error) is recorded as failed and the sweep goes on;
harness.callbacks.AggregateCallback lists it and exits 1. Ctrl-C or SIGTERM
leaves the finished prompts on disk and exits 130; re-running resumes.
"""

import json
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from harness.callbacks import in_multirun, record_job, write_aggregate
from harness.errors import HarnessError
from harness.report import format_summary


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from transformers.utils import logging as hf_logging

    from harness.run import run_cell

    hf_logging.disable_progress_bar()  # loading bars would bury the table; tqdm over prompts stays

    try:
        summary = run_cell(cfg)
    except KeyboardInterrupt:
        again = ("run it again with force=false to resume (force=true starts the cell over)" if cfg.get("force") is True
                 else "run the same command again to resume")
        print(f"interrupted: finished prompts are saved; {again}", file=sys.stderr)
        record_job(_cell_of(cfg), error="interrupted", status="interrupted")
        if in_multirun():  # Hydra's on_job_end does not run after an interrupt: list the sweep's jobs so far now
            write_aggregate(HydraConfig.get().sweep.dir)
        sys.exit(130)
    except (HarnessError, torch.OutOfMemoryError) as err:
        message = str(err).splitlines()[0] if isinstance(err, HarnessError) else f"out of memory: {str(err).splitlines()[0]}"
        print(f"error: {message}", file=sys.stderr)
        record_job(error=message)
        _record_failure(cfg, message)
        exit_code = getattr(err, "exit_code", 1)
        del err
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the next cell of a sweep the memory this one held
        if in_multirun():
            return float("nan")
        sys.exit(exit_code)
    except Exception as err:
        _record_failure(cfg, f"{type(err).__name__}: {err}")
        if not in_multirun():
            raise  # a bug, not a user mistake: keep the traceback
        # One failing cell (a model that will not load, a runtime error) must not end the sweep.
        print(f"error: cell failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
        record_job(error=f"{type(err).__name__}: {err}")
        return float("nan")
    record_job(summary)
    print(format_summary(summary))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("categories", "prompt_ids")}))
    return summary["speedup"]


def _cell_of(cfg: DictConfig) -> dict:
    """The cell a job was running (its key and directory), for its pointer; {} if it cannot be named."""
    from harness.run import cell_path, with_default_pair

    try:
        path = cell_path(with_default_pair(cfg))
    except Exception:  # a config that did not get as far as a cell
        return {}
    return {"cell": path.name, "cell_dir": str(path)}


def _record_failure(cfg: DictConfig, error: str) -> None:
    """Under `wandb agent`, a W&B run that says why the cell failed, if it failed before opening one."""
    from harness import tracking
    from harness.run import with_default_pair

    try:
        cfg = with_default_pair(cfg)
    except Exception:  # the pair is what failed: the run gets the config as given
        pass
    cell_dir = _cell_of(cfg).get("cell_dir") or Path(str(cfg.get("out_dir") or "results")) / "failed-cell"
    tracking.record_failure(cfg, cell_dir, error.splitlines()[0] if error else error)


if __name__ == "__main__":
    from harness.run import check_choices

    check_choices(sys.argv[1:])
    main()
