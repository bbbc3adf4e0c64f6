"""Linear layers for the few rows of a decoding step, on a CPU.

A decode, draft or verify step feeds every linear layer 1 to k + 1 rows. On
some CPUs torch's product for such rows, x [M, K] @ W.T, is much slower than
the same product computed the other way round, (W [N, K] @ x.T).T: the BLAS
takes another path. Measured on a 2-core AMD EPYC (Zen 5), torch 2.13 with
MKL 2024.2, float32, over weights of SmolLM2-135M's linear-layer shapes read
from memory: 35 ms for one row (a matrix-vector product, on one thread) and
52 ms for two, against 16 and 15 ms computed as W @ x.T (one row padded to
two). The two differ only in float rounding.

The BLAS also runs some row counts much slower than a few more: on the same
EPYC, W @ x.T over the pair's weights took 23.6 ms at four rows but 26.3 at
three, and 56.2 at sixteen but 86.0 to 105.2 at thirteen to fifteen (the
probe behind docs/design.md, "Linear layers on the CPU"). A
plan (`rows_to`) therefore says, for each row count, how many rows to
compute it with: the real ones, padded with zero rows.

`cpu_linear=auto` (the default) uses the plan stored for this machine and these
weights (`plan_key`: CPU model, torch threads, torch version, the layers' shapes), in
the harness's cache; with none stored it times both products at every row count up to
FEW_ROWS over the pair's own weights (`probe`, REPS sweeps), decides a plan that departs
from the simpler choice only beyond the sweeps' scatter (`plan`), and stores it, so that
the same command on the same machine runs the same kernels. `probe` times it anew and
stores the result; `transposed` (one row padded to two, no other padding) or `torch`
pick one product. The plan is recorded in a run's conditions. It changes the models'
modules, so HF generate() in the bench runs on the same products as our loop and the
comparison stays like for like.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.base.files import cache_root, json_digest, write_json_atomic
from harness.config.settings import CPU_LINEAR_MODES as MODES
from harness.errors import HarnessError

FEW_ROWS = 17  # k + 1 for k up to 16 (analysis' MAX_K); more rows (a prompt's pass): torch's own product
MARGIN = 0.9  # auto takes the transposed product for a row count only when it is clearly faster
NEAR = 1.05  # and pads a row count only to save more than this: closer times are within the probe's noise
NOISY = 1.25  # sweeps of a probe further apart than this (slowest / fastest, median over row counts): a warning
REPS = 7  # sweeps of a probe: a plan departs from the simpler choice only where the two sets of sweeps are apart by a margin
PROBE_BYTES = 2**30  # weights a probe pass reads, about (at least one layer): 0.1 s at 10 GB/s
AS_IS = tuple(range(FEW_ROWS + 1))  # a plan computing each row count as it is
ONE_AS_TWO = (0, 2, *range(2, FEW_ROWS + 1))  # cpu_linear=transposed: one row runs as a matrix-vector product, padded to two
PLAN_RULE = 2  # the version of `plan` a stored plan was decided by: a stored plan of another version is probed anew


def transposed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_to: tuple[int, ...] = ONE_AS_TWO
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] and weight [N, K]. The plan `rows_to` gives, for
    each row count M up to FEW_ROWS, the rows to compute it with as (weight @ rows.T).T, M padded
    with zero rows up to rows_to[M] (a count the BLAS runs faster), or 0 for torch's product."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if m > FEW_ROWS or not rows_to[m]:
        return F.linear(x, weight, bias)
    rows = x.reshape(m, x.shape[-1])  # [M, K]
    if rows_to[m] > m:
        rows = F.pad(rows, (0, 0, 0, rows_to[m] - m))  # [rows_to[M], K]
    out = torch.mm(weight, rows.T) if bias is None else torch.addmm(bias.unsqueeze(1), weight, rows.T)  # [N, rows_to[M]]
    out = out.T[:m].contiguous()  # [M, N]; contiguous, as the next layers run faster on it
    return out.reshape(*x.shape[:-1], weight.shape[0])


class TransposedLinear(nn.Linear):
    """nn.Linear computing few-row products as W @ x.T (`transposed_linear`) by its plan `rows_to`."""

    rows_to: tuple[int, ...] = ONE_AS_TWO  # apply() sets each layer's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return transposed_linear(x, self.weight, self.bias, self.rows_to)


def _linears(models: list[nn.Module]) -> list[nn.Module]:
    """The linear layers of the models, each once (a shared module counted once). A module
    that is not an nn.Linear takes part when it has a `rows_to` plan (a draft's subset head); one whose forward is replaced on the instance (accelerate's offloading hooks) does not."""
    seen: dict[int, nn.Module] = {}
    for model in models:
        for module in model.modules():
            if "forward" in vars(module):
                continue
            if type(module) in (nn.Linear, TransposedLinear) or hasattr(module, "rows_to"):
                seen.setdefault(id(module), module)
    return list(seen.values())


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


@torch.inference_mode()
def probe(models: list[nn.Module], rows: tuple[int, ...] = AS_IS[1:], reps: int = REPS) -> dict:
    """Time of one step through the models' linear layers for each row count, ms, with torch's
    product and with the transposed one (unpadded): the median of `reps` sweeps over the row
    counts, so that a passing disturbance lands in one sweep and a drift in all row counts
    alike. Each pass reads every layer's own weight once, as a step does, so that the weights
    come from memory rather than a warm cache; past PROBE_BYTES of weights, a seeded random
    sample of the layers, the time scaled up by bytes."""
    started = time.perf_counter()
    layers = _linears(models)
    size = {id(layer): layer.weight.numel() * layer.weight.element_size() for layer in layers}
    sample, taken = [], 0
    for layer in random.Random(0).sample(layers, len(layers)):
        if sample and taken + size[id(layer)] > PROBE_BYTES:
            continue
        sample.append(layer)
        taken += size[id(layer)]
    scale = sum(size.values()) / taken
    weights = [layer.weight for layer in sample]
    gen = torch.Generator().manual_seed(0)  # the global generator's state stays the run's
    passes = {}  # row count -> (torch's pass, the transposed pass), each through every sampled layer
    for m in rows:
        inputs = {
            (w.shape[1], w.dtype, w.device): torch.randn(m, w.shape[1], generator=gen).to(w.device, w.dtype) for w in weights
        }
        pairs = [(inputs[w.shape[1], w.dtype, w.device], w) for w in weights]  # ([M, K], [N, K]) per layer
        passes[m] = (
            lambda pairs=pairs: [F.linear(x, w) for x, w in pairs],
            lambda pairs=pairs: [transposed_linear(x, w, None, AS_IS) for x, w in pairs],
        )
        one_per_shape = list({(w.shape, w.dtype, w.device): (x, w) for x, w in pairs}.values())
        for x, w in one_per_shape:  # warm-up: each product, shape and row count once (allocations, BLAS set-up)
            F.linear(x, w), transposed_linear(x, w, None, AS_IS)
    times = {m: ([], []) for m in rows}
    for _ in range(reps):
        for m in rows:
            for product, timed in zip(passes[m], times[m]):
                timed.append(scale * _ms(product))
    # How far the sweeps disagreed: the median over row counts and products of slowest / fastest sweep.
    spread = statistics.median(max(t) / min(t) for m in rows for t in times[m] if min(t) > 0) if reps > 1 else 1.0
    return {
        "rows": list(rows),
        "torch_ms": [statistics.median(times[m][0]) for m in rows],
        "transposed_ms": [statistics.median(times[m][1]) for m in rows],
        "spread": spread,
        "sweeps": {"torch_ms": [times[m][0] for m in rows], "transposed_ms": [times[m][1] for m in rows]},
        "seconds": time.perf_counter() - started,
    }


def noisy(found: dict) -> str | None:
    """A warning when a probe's sweeps disagreed by more than NOISY (another process using the
    cores, say): its plan may then be off, and so may the run's timings. The spread comes from
    the extremes (slowest / fastest), not from the sweeps `clearly_faster` compares: the one
    disturbed sweep the plan leaves aside still says that the machine was busy during the probe,
    and may be during the run, so such a probe serves its run but is not stored (`choose`)."""
    spread = found.get("spread", 1.0)
    if spread <= NOISY:
        return None
    return (
        f"cpu_linear=auto: the probe's sweeps disagreed by {100 * (spread - 1):.0f}% (median over row counts): "
        f"is something else using these cores? Its plan, and this run's timings, may be off; "
        f"cpu_linear=transposed or torch skips the probe"
    )


def inner_range(sweeps: list[float]) -> tuple[float, float]:
    """(second-fastest, second-slowest) of a set of sweeps: one disturbed sweep, however far off,
    leaves both within the other sweeps' range, as it does not the fastest or the slowest. With
    fewer than three sweeps there is no such pair: (fastest, slowest)."""
    times = sorted(sweeps)
    return (times[1], times[-2]) if len(times) >= 3 else (times[0], times[-1])


def clearly_faster(fast: list[float], slow: list[float], margin: float) -> bool:
    """Sweeps `fast` beat sweeps `slow` by `margin` beyond the sweeps' own scatter, not only at the
    medians: the second-slowest of `fast` under `margin` times the second-fastest of `slow`. One
    disturbed sweep on each side (a slow one among `fast`, a fast one among `slow`) cannot decide
    it; a difference in all the other sweeps still does."""
    return inner_range(fast)[1] < margin * inner_range(slow)[0]


def plan(found: dict) -> tuple[int, ...] | None:
    """rows_to from a probe. For each row count M: the transposed product padded to M' > M rows
    only where M' is clearly faster than M (`clearly_faster` by 1 / NEAR: beyond the sweeps' own
    scatter), at the fewest rows among the paddings not clearly slower than the fastest one;
    then that product only where it is clearly faster than torch's at M (`clearly_faster` by
    MARGIN). Anything within the probe's noise keeps the simpler choice (no padding; torch's
    product), so that probes on one machine agree. One row is the exception: its simpler choice
    is the transposed product padded to two (as `cpu_linear=transposed` runs it), and torch's
    product only where that is clearly faster. Unpadded, one row is a matrix-vector product,
    which the BLASes measured run on one thread; the probe's sweeps at one and two rows can
    overlap while a model's whole step is clearly faster padded (docs/design.md, "Linear layers
    on the CPU"), and one row is every step of the target alone, the baseline of every speedup.
    None: torch's product at every row count."""
    torch_ms = dict(zip(found["rows"], found["torch_ms"]))
    sweeps = found.get("sweeps") or {}
    sweeps_of = {
        name: dict(zip(found["rows"], sweeps.get(name) or [[t] for t in found[name]])) for name in ("torch_ms", "transposed_ms")
    }
    rows_to = [0] * (FEW_ROWS + 1)
    transposed, torch_sweeps = sweeps_of["transposed_ms"], sweeps_of["torch_ms"]
    for m in torch_ms:
        one_as_two = m == 1 and 2 in transposed  # one row's simpler choice: padded to two (ONE_AS_TWO)
        rows = start = 2 if one_as_two else m
        better = {
            n: transposed[n] for n in transposed if n > start and clearly_faster(transposed[n], transposed[start], 1 / NEAR)
        }
        if better:  # padding pays: the fewest rows not clearly slower than the fastest padding
            fastest = better[min(better, key=lambda n: statistics.median(better[n]))]
            rows = min(n for n, times in better.items() if not clearly_faster(fastest, times, 1 / NEAR))
        if one_as_two:
            rows_to[m] = 0 if clearly_faster(torch_sweeps[m], transposed[rows], MARGIN) else rows
        elif clearly_faster(transposed[rows], torch_sweeps[m], MARGIN):
            rows_to[m] = rows
    return tuple(rows_to) if any(rows_to) else None


def describe(rows_to: tuple[int, ...] | list[int] | None) -> str:
    """A plan in a few words: which row counts are padded, and which take torch's product."""
    if not rows_to:
        return "torch's product"
    padded = [f"{m}->{n}" for m, n in enumerate(rows_to) if n and n != m]
    own = [str(m) for m, n in enumerate(rows_to) if m and not n]
    return (
        "W @ x.T"
        + (f", rows padded {', '.join(padded)}" if padded else "")
        + (f"; torch's product at {', '.join(own)} rows" if own else "")
    )


def apply(models: list[nn.Module], rows_to: tuple[int, ...] | list[int] | None) -> None:
    """Give the models' linear layers the plan rows_to (None: torch's own product)."""
    rows_to = tuple(rows_to) if rows_to else None
    for layer in _linears(models):
        if type(layer) in (nn.Linear, TransposedLinear):  # a subset head keeps its class and reads its plan
            layer.__class__ = TransposedLinear if rows_to else nn.Linear
        layer.rows_to = rows_to


def plan_key(models: list[nn.Module], identity: dict) -> dict:
    """What a plan depends on: the device (CPU model and torch threads), torch's version, the
    shapes and dtypes of the linear layers it times, and the rule (`plan`) that decided it."""
    shapes = Counter((*layer.weight.shape, str(layer.weight.dtype)) for layer in _linears(models))
    shapes = sorted([*shape, count] for shape, count in shapes.items())
    return {"device": identity, "torch": torch.__version__, "shapes": shapes, "rule": PLAN_RULE}


def plan_path(key: dict) -> Path:
    """Where the plan for `key` is stored: one file a machine and model shape, in the harness's
    cache (`SPECBENCH_PLANS` moves the folder)."""

    digest = json_digest(key, 16)
    return Path(os.environ.get("SPECBENCH_PLANS") or cache_root() / "cpu_linear") / f"{digest}.json"


def stored_plan(key: dict) -> dict | None:
    """The plan stored for `key`, or None (none yet, or a file that does not read as one)."""
    try:
        stored = json.loads(plan_path(key).read_text())
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) and stored.get("key") == key and "probe" in stored else None


def choose(mode: str, models: list[nn.Module], device: torch.device, identity: dict | None = None) -> dict:
    """Set the models' linear layers to the product `mode` asks for, on a CPU, and return what
    was chosen and why, for a run's conditions. `auto`: the plan stored for this machine and
    these shapes (`plan_key`; `identity` names the device), else a probe's plan, stored for
    later runs; `probe`: probe anew and store; `transposed` or `torch`: one product, no probe."""
    if mode not in MODES:
        raise HarnessError(f"cpu_linear={mode} must be one of {', '.join(MODES)}")
    if device.type != "cpu":
        return {"mode": mode, "product": "torch", "why": f"{device.type}: torch's own product"}
    found, rows_to, source = None, None, None
    if mode in ("auto", "probe") and _linears(models):
        key = plan_key(models, identity or {"type": "cpu", "threads": torch.get_num_threads()})
        stored = stored_plan(key) if mode == "auto" else None
        if stored:
            found, rows_to, source = stored["probe"], stored["rows_to"], "stored"
        else:
            found = probe(models)
            rows_to, source = plan(found), "probed"
            if noisy(found):  # a disturbed probe is used for this run only: the next run probes again
                source = "probed, not stored (noisy)"
        if source == "probed":
            path = plan_path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                path,
                {
                    "key": key,
                    "rows_to": list(rows_to) if rows_to else None,
                    "probe": found,
                    "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                },
            )
        rows_to = tuple(rows_to) if rows_to else None
    elif mode == "transposed":
        rows_to = ONE_AS_TWO
    apply(models, rows_to)
    chosen = {"mode": mode, "product": "transposed" if rows_to else "torch"}
    if source:
        chosen["plan"] = {"source": source, "file": str(plan_path(key))}
    return {**chosen, **({"rows_to": list(rows_to)} if rows_to else {}), **({"probe": found} if found else {})}
