"""Experiment tracking (W&B). Placeholder interface: the loop of run_cell calls
`start(cfg, cell_dir)` before the first prompt and `finish(...)` at the end."""

from __future__ import annotations


class NoTracking:
    def log_prompt(self, record: dict) -> None:
        pass

    def finish(self, summary: dict, records: list[dict], status: str = "finished") -> None:
        pass


def start(cfg, cell_dir) -> NoTracking:
    return NoTracking()
