"""The device's memory bandwidth, measured once per machine by a large copy, and how far a step is from it.

A decode step reads every weight and the KV cache once; at batch sizes a decode runs at it is bound by
memory, so the time to read those bytes at the device's bandwidth is its floor. `limit_ratio` = step time
/ that floor: 1 is the hardware's limit, and what is above it is the forward's and the loop's to win back.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from harness.base.files import cache_root, json_digest, write_json_atomic

COPY_BYTES = 2**28  # one buffer, larger than any cache: the copy reads it and writes as much
REPS = 9  # copies timed; the median is the figure, slowest / fastest its spread
NOISY = 1.25  # a spread above this is not stored (as a CPU linear probe's)


def probe(device: torch.device, nbytes: int = COPY_BYTES, reps: int = REPS) -> dict:
    """GB/s of a copy of nbytes on the device (read and written: 2 x nbytes moved over the time), the median of reps."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    rates = []
    for rep in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:  # the first copy warms up (allocation, first touch of the pages)
            rates.append(2 * nbytes / (time.perf_counter() - start) / 1e9)
    return {"gb_per_s": statistics.median(rates), "spread": max(rates) / min(rates), "samples": rates, "bytes": nbytes}


def measured(device: torch.device, identity: dict) -> dict:
    """The bandwidth of this device (`identity`: harness.base.device.device_identity), probed on the
    first run and stored in the harness's cache (`SPECBENCH_BANDWIDTH` moves the folder), as the CPU
    linear plans are; {"source": "stored" or "probed", "file": ...} say where it came from."""
    key = {"device": identity, "torch": torch.__version__, "bytes": COPY_BYTES}
    path = Path(os.environ.get("SPECBENCH_BANDWIDTH") or cache_root() / "bandwidth") / f"{json_digest(key, 16)}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and stored.get("gb_per_s", 0) > 0:
            return {**stored, "source": "stored", "file": str(path)}
    except (OSError, ValueError, AttributeError):
        pass
    found = {"key": key, **probe(device)}
    if found["spread"] > NOISY:  # a busy machine: this run uses it, the next one probes again
        return {**found, "source": "probed, not stored (noisy)", "file": str(path)}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, found)
    return {**found, "source": "probed", "file": str(path)}


def limit_ratio(step_s: float, bytes_per_step: float, gb_per_s: float) -> float:
    """A step's time over the time to read its bytes once at the device's bandwidth."""
    return step_s / (bytes_per_step / (gb_per_s * 1e9))
