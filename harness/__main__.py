"""`python -m harness`: the Hydra entry point, thin over harness.run.run_cell.

In a multirun (-m) a cell that fails with a HarnessError is recorded and the
sweep goes on; harness.callbacks.AggregateCallback lists it and exits 1.
"""

import json
import sys

import hydra
from omegaconf import DictConfig

from harness.callbacks import in_multirun, record_job
from harness.errors import HarnessError
from harness.report import format_summary


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from transformers.utils import logging as hf_logging

    from harness.run import run_cell

    hf_logging.disable_progress_bar()  # loading bars would bury the table; tqdm over prompts stays

    try:
        summary = run_cell(cfg)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        record_job(error=str(err))
        if in_multirun():
            return float("nan")
        sys.exit(err.exit_code)
    record_job(summary)
    print(format_summary(summary))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("categories", "prompt_ids")}))
    return summary["speedup"]


if __name__ == "__main__":
    main()
