"""What a cell's figures depend on beyond its config, and where they were measured: the machine, the
libraries and the harness's commit, the run's conditions, and the process's memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import resource
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig

from harness.base.device import cpu_name, cpuinfo, device_name

if TYPE_CHECKING:
    from harness.runner.pair import Pair

ROOT = Path(__file__).resolve().parents[2]  # the harness's checkout


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second (e.g. "2025-01-31T12:00:00+00:00")."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    """The machine a process runs on: the CPU's model, the physical cores and hardware threads it may use,
    the GPUs it sees and the total memory, e.g. {"cpu": "AMD EPYC", "cores": 2, "threads": 2, "gpu": None,
    "gpus": 0, "memory_gb": 23.5}."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cpus = {cpu.get("processor"): cpu for cpu in cpuinfo()}
    placed = [cpus.get(str(n), {}) for n in usable]
    if placed and all("core id" in cpu for cpu in placed):  # hyperthreads share a (package, core)
        cores = len({(cpu.get("physical id"), cpu["core id"]) for cpu in placed})
    else:
        cores = len(usable)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = ", ".join(sorted({torch.cuda.get_device_name(n) for n in range(gpus)})) or None
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        memory_gb = None
    return {"cpu": cpu_name(), "cores": cores, "threads": len(usable), "gpu": gpu, "gpus": gpus, "memory_gb": memory_gb}


def libraries() -> str:
    """The libraries a prompt's timings depend on most, as one record field."""
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


@functools.cache
def harness_commit(root: Path = ROOT) -> str | None:
    """The git commit of the harness's checkout (-dirty with uncommitted changes); else SPECBENCH_COMMIT, which a
    copy of the tree without .git may set (scripts/gpu_check.sh)."""
    if not (root / ".git").exists():
        return os.environ.get("SPECBENCH_COMMIT") or None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def conditions(cfg: DictConfig, pair: Pair) -> dict:
    """What a run's figures depend on beyond its config: device, dtype, threads, versions, machine, linear plan."""
    import transformers

    on_gpu = pair.device.type == "cuda"
    capability = ".".join(map(str, torch.cuda.get_device_capability(pair.device))) if on_gpu else None
    return {
        "device": str(pair.device),
        "device_name": device_name(pair.device),
        "dtype": str(next(pair.target.model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "seed": cfg.seed,
        "hostname": platform.node(),
        "harness_commit": harness_commit(),
        "machine": machine(),
        "forward": "lean" if pair.target.lean is not None else "hf",  # as forward=auto resolved, for the target
        **({"draft_forward": "lean" if pair.drafter.lm.lean is not None else "hf"} if hasattr(pair.drafter, "lm") else {}),
        **({"linear": pair.linear} if pair.linear else {}),
        **({"batch": batch_conditions(cfg, pair)} if cfg.get("batch_size", 1) > 1 else {}),
        **({"cuda": torch.version.cuda, "capability": capability} if on_gpu else {}),
    }


def batch_conditions(cfg: DictConfig, pair: Pair) -> dict:
    """How a batch_size > 1 cell batches its prompts (harness.core.loop, harness.models.batched)."""
    from harness.models.batched import rows_of

    return {
        "size": cfg.batch_size,
        "rows": "consecutive prompts of the selection, the last batch possibly smaller",
        "layout": rows_of(pair.target, cfg.batch_size).layout,
        "draft": type(pair.drafter).__name__,
        "finished_rows": "leave the batch at the end of their cycle (or step): later passes run the rows still decoding",
        "speedup": "per batch, spec tokens/s over baseline tokens/s on the same rows; the interval bootstraps batches",
    }


# Memory.


def reset_peak_rss() -> bool:
    """Start the peak resident memory afresh for this cell (Linux: 5 to clear_refs resets VmHWM); False where
    that cannot be done."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
        return True
    return False


def peak_rss_mb(since_reset: bool) -> tuple[float, str]:
    """(peak resident memory in MB, over what): "cell" since a successful reset_peak_rss, else "process"."""
    if since_reset:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            line = next(row for row in Path("/proc/self/status").read_text().splitlines() if row.startswith("VmHWM:"))
            return int(line.split()[1]) / 1024, "cell"
    return process_peak_rss_mb(), "process"


def process_peak_rss_mb() -> float:
    """The process's peak resident memory in MB (getrusage: kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def current_rss_mb() -> float:
    """Resident memory now (Linux /proc), to show it does not grow across prompts."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def memory_growth(records: list[dict]) -> dict:
    """Resident memory after the first and last prompt, and its fitted growth per prompt (linregress)."""
    rss = [r["rss_mb"] for r in records if r.get("rss_mb") is not None]
    if len(rss) < 3:
        return {}
    from scipy import stats

    slope = float(stats.linregress(range(len(rss)), rss).slope)
    return {"rss_first_mb": rss[0], "rss_last_mb": rss[-1], "rss_growth_mb_per_prompt": slope}
