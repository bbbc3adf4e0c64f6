"""Prompt sets, chosen by the `dataset` config group (conf/dataset/).

`load_prompts(dataset_cfg)` returns a list of {"id", "category", "prompt"}
dicts; the category travels into every result.
"""

from __future__ import annotations

from harness.errors import HarnessError
from harness.prompts import load_builtin


def load_prompts(dataset_cfg) -> list[dict]:
    if dataset_cfg.source == "builtin":
        return load_builtin()
    raise HarnessError(f"dataset.source={dataset_cfg.source} is not supported yet: use builtin")
