"""What a device is: the model of its CPU or GPU, and what of it a cell's results depend on."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU (empty where there is no such file)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return []
    blocks = [(line.partition(":") for line in block.splitlines()) for block in text.split("\n\n")]
    return [fields for fields in ({k.strip(): v.strip() for k, _, v in lines if k.strip()} for lines in blocks) if fields]


def cpu_name() -> str:
    """The CPU's model (e.g. "AMD EPYC 7763 64-Core Processor"), as /proc/cpuinfo or the platform names it."""
    names = (cpu.get("model name") for cpu in cpuinfo())
    return next((name for name in names if name), None) or platform.processor() or "cpu"


def device_name(device: torch.device) -> str:
    """The model of a GPU (e.g. "NVIDIA H200") or of the CPU (e.g. "AMD EPYC")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def device_identity(device: torch.device) -> dict:
    """What of a device a cell's results depend on: its type and model, not its index; on a CPU its torch threads."""
    identity = {"type": device.type, "name": device_name(device)}
    if device.type == "cpu":
        identity["threads"] = torch.get_num_threads()
    return identity


GPU_CLOCKS = ("clocks.sm", "clocks.mem", "clocks.max.sm", "temperature.gpu", "power.draw")  # nvidia-smi's names


def gpu_clocks(device: torch.device) -> dict | None:
    """The GPU's clocks now (SM and memory MHz, the SM's maximum, temperature C, power W) from nvidia-smi (a
    throttled GPU times other costs); None on a CPU, without nvidia-smi, or when it cannot answer."""
    if device.type != "cuda" or not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", f"--query-gpu={','.join(GPU_CLOCKS)}", "--format=csv,noheader,nounits", "-i", str(device.index or 0)]
    try:
        line = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    values = [v.strip() for v in line.split(",")]
    return {key: _number(v) for key, v in zip(GPU_CLOCKS, values)} if len(values) == len(GPU_CLOCKS) else None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None
