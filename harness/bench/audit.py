"""What the loop asks of the host: every host read during a decode (`sync_audit`), and one prompt's
kernels and host waits per cycle and per pass (`cycle_profile`)."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import torch

from harness.base.host_reads import HostReads
from harness.bench.contenders import GREEDY, ForwardCounter
from harness.core.loop import speculative_decode
from harness.core.sampling import Sampling
from harness.runner.costs import sync


def decoder(pair, ids, k: int, n: int, sampling: Sampling, device):
    """A speculative decode of one prompt that gives the same cycles every time it is called."""

    def decode() -> list:
        generator = torch.Generator(device).manual_seed(0)
        return list(speculative_decode(pair.target, pair.drafter, ids, k, sampling, n, pair.eos_ids, generator))

    return decode


def sync_audit(pair, ids, k: int, n: int, device) -> dict:
    """Every host read of a tensor value during speculative decoding of one
    prompt, greedy and sampled, counted by the source line that asked for it
    (`HostReads`, on any device), and on CUDA every synchronisation the device
    reports (torch.cuda.set_sync_debug_mode), which also sees those made inside
    kernels. The loop's own is one per cycle (loop.py: the accepted counts and
    committed tokens together); none is per drafted token."""
    cuda = device.type == "cuda"
    out = {}
    for name, sampling in (("greedy", GREEDY), ("T=1", Sampling(1.0))):
        decode = decoder(pair, ids, k, n, sampling, device)
        decode()  # warm
        sync(device)
        with HostReads() as reads:
            cycles = decode()
        drafted = sum(c.num_drafted for c in cycles)
        out[name] = {
            "cycles": len(cycles),
            "drafted": drafted,
            "host_reads": reads.total,
            "host_reads_per_cycle": reads.total / len(cycles),
            "host_reads_by_line": dict(reads.sites.most_common()),
        }
        if cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    cycles = decode()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
            out[name].update(
                syncs=sum(where.values()), syncs_per_cycle=sum(where.values()) / len(cycles), by_line=dict(where.most_common())
            )
    return out


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")  # one kernel each
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # the host blocks


def cycle_profile(pair, ids, k: int, n: int, device) -> dict:
    """One prompt's speculative decode (greedy, after a warm run) under torch.profiler: per cycle and
    per pass (the target's forward passes and one draft step a drafted token, for drafters that run a
    model), the kernels launched and the host's waits. CUDA: kernel launches and CUDA-graph launches
    (a captured step is one graph launch, its kernels not launched one by one), and the calls in which
    the host waits for the device. CPU: the operators dispatched at the top level (a compiled graph's
    call counts once) and no waits (the CPU runs each operator as it is called). On any device, the
    host reads the project counts (harness.base.host_reads), the loop's one a cycle among them."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    decode = decoder(pair, ids, k, n, GREEDY, device)
    decode()  # warm
    sync(device)
    counter = ForwardCounter(pair.target.model)
    with HostReads() as reads, profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        cycles = decode()
        sync(device)
    counter.handle.remove()
    events = prof.events()
    names = Counter(event.name for event in events)
    if cuda:
        kernels, waits = sum(names[name] for name in LAUNCHES), sum(names[name] for name in WAITS)
    else:
        top = [event.name for event in events if event.cpu_parent is None]
        kernels, waits = sum(name.startswith("aten::") or "CompiledFxGraph" in name for name in top), 0
    draft_steps = sum(c.num_drafted for c in cycles) if pair.drafter.forwards else 0
    counts = {"kernels": kernels, "graph_launches": names["cudaGraphLaunch"], "device_waits": waits, "host_reads": reads.total}
    passes = counter.count + draft_steps
    return {
        "cycles": len(cycles),
        "target_passes": counter.count,
        "draft_steps": draft_steps,
        **counts,
        "per_cycle": {name: value / len(cycles) for name, value in counts.items()},
        "per_pass": {name: value / passes for name, value in counts.items()} if passes else None,
        "kernels_are": "CUDA kernel launches" if cuda else "top-level CPU operators (a compiled graph's call: one)",
    }
