"""Linear layers for the few rows of a decoding step, on a CPU.

For 1 to k + 1 rows some CPUs' BLAS runs x [M, K] @ W.T much slower than (W [N, K] @ x.T).T, and
some row counts slower than a few more. A plan (`rows_to`) says, for each row count, how many rows
to compute it with as W @ x.T (zero rows padded), or 0 for torch's product (docs/design.md, "Linear
layers on the CPU"). Plans are per weight shape and per machine: `cpu_linear=auto` uses those stored
for this machine and probes a shape with none on the products a step really runs (the lean forward's
fused ones included), so every pair with a shape shares its plan and a target keeps its products
whatever its draft. The plans change the models' own modules, so HF generate() in the bench runs on
the same products as our loop.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
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
PROBE_BYTES = 2**30  # weights a probe pass reads, at most: past it, a seeded sample of each shape's weights
MIN_PASS_BYTES = 2**28  # and at least: fewer (small models, one new shape) are repeated, so that a pass reads memory, not cache
MAX_REPEAT = 16  # up to this many times (tiny models run from cache anyway)
AS_IS = tuple(range(FEW_ROWS + 1))  # a plan computing each row count as it is
ONE_AS_TWO = (0, 2, *range(2, FEW_ROWS + 1))  # cpu_linear=transposed: one row runs as a matrix-vector product, padded to two
EVERY_SHAPE = "*"  # a plans' key for the shapes it does not name
PLAN_RULE = 3  # the version of `plan` and `probe` stored plans were decided by: others are probed anew

Plans = dict[str, "tuple[int, ...] | None"]  # weight shape (`shape_of`) -> rows_to (None: torch's product)


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


def planned_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows_to: tuple[int, ...] | None
) -> torch.Tensor:
    """F.linear by the plan rows_to (None: torch's product), for a product that is no module's (the lean forward's fused ones)."""
    return transposed_linear(x, weight, bias, rows_to) if rows_to else F.linear(x, weight, bias)


class TransposedLinear(nn.Linear):
    """nn.Linear computing few-row products as W @ x.T (`transposed_linear`) by its plan `rows_to`."""

    rows_to: tuple[int, ...] = ONE_AS_TWO  # apply() sets each layer's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return transposed_linear(x, self.weight, self.bias, self.rows_to)


def shape_of(weight: torch.Tensor) -> str:
    """A plan's key: the weight's [N, K] and dtype, as `960x576 float32`."""
    return f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')}"


def rows_for(plans: Plans | None, weight: torch.Tensor) -> tuple[int, ...] | None:
    """The plan for this weight's shape (EVERY_SHAPE for a shape not named), or None: torch's product."""
    if not plans:
        return None
    return plans.get(shape_of(weight), plans.get(EVERY_SHAPE))


def _linears(models: list[nn.Module]) -> list[nn.Module]:
    """The linear layers of the models, each once; a module with a `rows_to` plan (a subset head) too,
    not one whose forward is replaced on the instance (accelerate's offloading hooks)."""
    seen: dict[int, nn.Module] = {}
    for model in models:
        for module in model.modules():
            if "forward" in vars(module):
                continue
            if type(module) in (nn.Linear, TransposedLinear) or hasattr(module, "rows_to"):
                seen.setdefault(id(module), module)
    return list(seen.values())


def step_weights(models: list[nn.Module]) -> dict[str, list[torch.Tensor]]:
    """The weights of every product a step of these models can run, by shape: each linear layer's
    and the fused ones the lean forward computes with (`fused_linear_weights`), each once."""
    weights = [layer.weight for layer in _linears(models)]
    weights += [w for model in models for w in getattr(model, "fused_linear_weights", [])]
    by_shape: dict[str, dict[int, torch.Tensor]] = {}
    for w in weights:
        by_shape.setdefault(shape_of(w), {}).setdefault(id(w), w)
    return {shape: list(ws.values()) for shape, ws in by_shape.items()}


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def _pass_weights(weights: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """The weights a probe pass reads, by shape: at most PROBE_BYTES in all (a seeded sample of each
    shape, at least one weight), at least MIN_PASS_BYTES (each shape's weights repeated as copies)."""
    size = {shape: ws[0].numel() * ws[0].element_size() for shape, ws in weights.items()}
    total = sum(size[shape] * len(ws) for shape, ws in weights.items())
    share = min(1.0, PROBE_BYTES / total)
    taken = {
        shape: random.Random(0).sample(ws, max(1, round(share * len(ws)))) if share < 1 else list(ws)
        for shape, ws in weights.items()
    }
    taken_bytes = sum(size[shape] * len(ws) for shape, ws in taken.items())
    repeat = min(math.ceil(MIN_PASS_BYTES / taken_bytes), MAX_REPEAT)
    return {shape: ws + [w.clone() for _ in range(repeat - 1) for w in ws] for shape, ws in taken.items()}


@torch.inference_mode()
def probe(weights: dict[str, list[torch.Tensor]], rows: tuple[int, ...] = AS_IS[1:], reps: int = REPS) -> dict:
    """ms per weight of each shape's product, torch's and the transposed one (unpadded), per row count:
    the median of `reps` sweeps. A sweep makes, per row count and product, one pass through every
    shape's weights (`_pass_weights`), each shape timed on its own, so that its weights come from
    memory after the others', as in a step."""
    started = time.perf_counter()
    taken = _pass_weights(weights)
    products = (F.linear, lambda x, w: transposed_linear(x, w, None, AS_IS))
    gen = torch.Generator().manual_seed(0)  # the global generator's state stays the run's
    inputs = {}  # (row count, K, dtype) -> x [M, K]
    for m in rows:
        for w in (ws[0] for ws in taken.values()):
            if (m, w.shape[1], w.dtype) not in inputs:
                x = inputs[m, w.shape[1], w.dtype] = torch.randn(m, w.shape[1], generator=gen).to(w.device, w.dtype)
                [product(x, w) for product in products]  # warm-up: each product, shape and row count once
    times = {shape: {m: ([], []) for m in rows} for shape in taken}
    for _ in range(reps):
        for m in rows:
            for p, product in enumerate(products):
                for shape, ws in taken.items():
                    x = inputs[m, ws[0].shape[1], ws[0].dtype]
                    times[shape][m][p].append(_ms(lambda ws=ws, x=x, product=product: [product(x, w) for w in ws]) / len(ws))
    found = {}
    for shape, by_rows in times.items():
        sweeps = [t for m in rows for t in by_rows[m] if min(t) > 0]
        found[shape] = {
            "rows": list(rows),
            "torch_ms": [statistics.median(by_rows[m][0]) for m in rows],
            "transposed_ms": [statistics.median(by_rows[m][1]) for m in rows],
            "spread": statistics.median(max(t) / min(t) for t in sweeps) if reps > 1 and sweeps else 1.0,
            "sweeps": {"torch_ms": [by_rows[m][0] for m in rows], "transposed_ms": [by_rows[m][1] for m in rows]},
            "weights": len(taken[shape]),
        }
    return {"shapes": found, "seconds": time.perf_counter() - started}


def noisy(found: dict) -> str | None:
    """A warning when a shape's probe sweeps disagreed by more than NOISY (slowest / fastest: a busy
    machine): such a plan serves its run but is not stored (`choose`)."""
    spread = found.get("spread", 1.0)
    if spread <= NOISY:
        return None
    return (
        f"cpu_linear=auto: the probe's sweeps disagreed by {100 * (spread - 1):.0f}% (median over row counts): "
        f"is something else using these cores? Its plan, and this run's timings, may be off; "
        f"cpu_linear=transposed or torch skips the probe"
    )


def inner_range(sweeps: list[float]) -> tuple[float, float]:
    """(second-fastest, second-slowest) of the sweeps, which one disturbed sweep cannot move; (fastest, slowest) under three."""
    times = sorted(sweeps)
    return (times[1], times[-2]) if len(times) >= 3 else (times[0], times[-1])


def clearly_faster(fast: list[float], slow: list[float], margin: float) -> bool:
    """The second-slowest of `fast` under `margin` times the second-fastest of `slow` (`inner_range`)."""
    return inner_range(fast)[1] < margin * inner_range(slow)[0]


def plan(found: dict) -> tuple[int, ...] | None:
    """rows_to from one shape's probe. Row count M is padded to M' only where M' is clearly faster
    (by 1 / NEAR), at the fewest rows not clearly slower than the fastest padding; the transposed
    product is taken only where clearly faster than torch's (by MARGIN). Within the noise the simpler
    choice stays, so probes on one machine agree; one row's simpler choice is the transposed product
    padded to two (docs/design.md). None: torch's product at every row count."""
    sweeps = found.get("sweeps") or {}
    transposed, torch_sweeps = (
        dict(zip(found["rows"], sweeps.get(name) or [[t] for t in found[name]])) for name in ("transposed_ms", "torch_ms")
    )
    rows_to = [0] * (FEW_ROWS + 1)
    for m in found["rows"]:
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


def describe(plans: Plans | dict | tuple | list | None) -> str:
    """Plans (or one plan, rows_to) in a few words: which row counts are padded, which take torch's product."""
    if isinstance(plans, dict):
        groups: dict[str, list[str]] = {}
        for shape, rows_to in sorted(plans.items()):
            groups.setdefault(describe(rows_to), []).append("every shape" if shape == EVERY_SHAPE else shape.split()[0])
        if len(groups) < 2:
            return next(iter(groups), "torch's product")
        return "; ".join(f"{', '.join(shapes)}: {how}" for how, shapes in groups.items())
    if not plans:
        return "torch's product"
    padded = [f"{m}->{n}" for m, n in enumerate(plans) if n and n != m]
    own = [str(m) for m, n in enumerate(plans) if m and not n]
    return (
        "W @ x.T"
        + (f", rows padded {', '.join(padded)}" if padded else "")
        + (f"; torch's product at {', '.join(own)} rows" if own else "")
    )


def apply(models: list[nn.Module], plans: Plans | dict | None) -> None:
    """Give each linear layer its shape's plan, and each model its fused products' plans, in the order of its
    `fused_linear_weights` (`fused_linear_plans`: looked up here, not at every step)."""
    plans = {shape: tuple(rows_to) if rows_to else None for shape, rows_to in (plans or {}).items()}
    for layer in _linears(models):
        rows_to = rows_for(plans, layer.weight)
        if type(layer) in (nn.Linear, TransposedLinear):  # a subset head keeps its class and reads its plan
            layer.__class__ = TransposedLinear if rows_to else nn.Linear
        layer.rows_to = rows_to
    for model in models:
        model.fused_linear_plans = [rows_for(plans, w) for w in getattr(model, "fused_linear_weights", [])]


def machine_key(identity: dict) -> dict:
    """What plans depend on besides the shape: the device (CPU model, torch threads), torch, the rule's version."""
    return {"device": identity, "torch": torch.__version__, "rule": PLAN_RULE}


def plan_path(key: dict) -> Path:
    """Where the plans for this machine are stored: one file, in the harness's cache (`SPECBENCH_PLANS` moves the folder)."""
    return Path(os.environ.get("SPECBENCH_PLANS") or cache_root() / "cpu_linear") / f"{json_digest(key, 16)}.json"


def stored_plans(key: dict) -> dict:
    """The plans stored for this machine, by shape ({rows_to, probe, created_utc}); {} when none or unreadable."""
    try:
        stored = json.loads(plan_path(key).read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(stored, dict) and stored.get("key") == key and isinstance(stored.get("shapes"), dict)
    return (
        {shape: entry for shape, entry in stored["shapes"].items() if isinstance(entry, dict) and "probe" in entry} if ok else {}
    )


def _probed(mode: str, models: list[nn.Module], identity: dict) -> dict:
    """auto / probe: the plans of the models' shapes, stored or probed now (and then stored unless noisy)."""
    weights = step_weights(models)
    key = machine_key(identity)
    stored = stored_plans(key)
    missing = {shape: ws for shape, ws in weights.items() if mode == "probe" or shape not in stored}
    probed = probe(missing) if missing else {"shapes": {}, "seconds": 0.0}
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    fresh = {shape: {"rows_to": plan(found), "probe": found, "created_utc": now} for shape, found in probed["shapes"].items()}
    keep = {shape: entry for shape, entry in fresh.items() if not noisy(entry["probe"])}
    if keep:
        path = plan_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"key": key, "shapes": {**stored_plans(key), **keep}})
    entries = {shape: fresh.get(shape) or stored[shape] for shape in weights}
    source = "stored" if not fresh else "probed" if len(keep) == len(fresh) else "probed, not stored (noisy)"
    return {
        "plans": {shape: list(entry["rows_to"]) if entry["rows_to"] else None for shape, entry in entries.items()},
        "plan": {"source": source, "file": str(plan_path(key)), "probed": sorted(fresh), "seconds": probed["seconds"]},
        "probe": {shape: {n: v for n, v in entry["probe"].items() if n != "sweeps"} for shape, entry in fresh.items()},
    }


def choose(mode: str, models: list[nn.Module], device: torch.device, identity: dict | None = None) -> dict:
    """Set the models' linear layers to the products `mode` asks for, on a CPU; what was chosen and why,
    for a run's conditions. `auto`: the stored plans, a shape without one probed and stored; `probe`:
    every shape probed anew; `transposed` or `torch`: one product for every shape, no probe."""
    if mode not in MODES:
        raise HarnessError(f"cpu_linear={mode} must be one of {', '.join(MODES)}")
    if device.type != "cpu":
        return {"mode": mode, "product": "torch", "why": f"{device.type}: torch's own product"}
    chosen: dict = {"plans": {}}
    if mode in ("auto", "probe") and _linears(models):
        chosen = _probed(mode, models, identity or {"type": "cpu", "threads": torch.get_num_threads()})
    elif mode == "transposed":
        chosen = {"plans": {EVERY_SHAPE: list(ONE_AS_TWO)}}
    apply(models, chosen["plans"])
    product = "transposed" if any(chosen["plans"].values()) else "torch"
    return {"mode": mode, "product": product, **{name: value for name, value in chosen.items() if value or name == "plans"}}
