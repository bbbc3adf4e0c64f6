"""Linear layers for the few rows of a decoding step, on a CPU.

A decode, draft or verify step feeds every linear layer 1 to k + 1 rows. On
some CPUs torch's product for such rows, x [M, K] @ W.T, is much slower than
the same product computed the other way round, (W [N, K] @ x.T).T: the BLAS
takes another path. Measured on a 2-core AMD EPYC (Zen 5), torch 2.13 with
MKL 2024.2, float32, over weights of SmolLM2-135M's linear-layer shapes read
from memory: 35 ms for one row (a matrix-vector product, on one thread) and
52 ms for two, against 16 and 15 ms computed as W @ x.T (one row padded to
two). The two differ only in float rounding.

`cpu_linear=auto` (the default) times both over the pair's own weights when
the pair is loaded and keeps the transposed product when it takes under
MARGIN of torch's time; `transposed` or `torch` pick one. The choice is per process and recorded in a run's conditions. It
changes the models' modules, so HF generate() in the bench runs on the same
products as our loop and the comparison stays like for like.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from harness.errors import HarnessError

MODES = ("auto", "transposed", "torch")
FEW_ROWS = 17  # k + 1 for k up to 16 (analysis' MAX_K); more rows (a prompt's pass): torch's own product
PROBE_ROWS = (1, 2, 3, 5, FEW_ROWS)  # a decoding step, a catch-up, verifies at k = 2, 4 and the most rows it takes
MARGIN = 0.9  # auto takes the transposed product only when it is clearly faster
PROBE_BYTES = 2**30  # weights a probe pass reads, about (at least one layer): 0.1 s at 10 GB/s


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] and weight [N, K], computed as (weight @ rows.T).T
    when x has at most FEW_ROWS rows."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if m > FEW_ROWS:
        return F.linear(x, weight, bias)
    rows = x.reshape(m, x.shape[-1])  # [M, K]
    if m == 1:
        rows = torch.cat([rows, rows])  # [2, K]: one row would run as a matrix-vector product
    out = torch.mm(weight, rows.T) if bias is None else torch.addmm(bias.unsqueeze(1), weight, rows.T)  # [N, M]
    out = out.T[:m].contiguous()  # [M, N]; contiguous, as the next layers run faster on it
    return out.reshape(*x.shape[:-1], weight.shape[0])


class TransposedLinear(nn.Linear):
    """nn.Linear computing few-row products as W @ x.T (`transposed_linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return transposed_linear(x, self.weight, self.bias)


def _linears(models: list[nn.Module]) -> list[nn.Module]:
    """The linear layers of the models, each once (a shared module counted once). A module
    that is not an nn.Linear takes part when it has a `transposed_product` flag (a draft's subset
    head); one whose forward is replaced on the instance (accelerate's offloading hooks) does not."""
    seen: dict[int, nn.Module] = {}
    for model in models:
        for module in model.modules():
            if "forward" in vars(module):
                continue
            if type(module) in (nn.Linear, TransposedLinear) or hasattr(module, "transposed_product"):
                seen.setdefault(id(module), module)
    return list(seen.values())


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def probe(models: list[nn.Module], rows: tuple[int, ...] = PROBE_ROWS, reps: int = 3) -> dict:
    """Time of one step through the models' linear layers for each row count, ms, with torch's
    product and with the transposed one. Each pass reads every layer's own weight once, as a
    step does, so that the weights come from memory rather than a warm cache; past PROBE_BYTES
    of weights, a seeded random sample of the layers, the time scaled up by bytes."""
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
    totals: dict[str, list[float]] = {"torch_ms": [], "transposed_ms": []}
    gen = torch.Generator().manual_seed(0)  # the global generator's state stays the run's
    for m in rows:
        inputs = {(w.shape[1], w.dtype, w.device): torch.randn(m, w.shape[1], generator=gen).to(w.device, w.dtype) for w in weights}
        pairs = [(inputs[w.shape[1], w.dtype, w.device], w) for w in weights]  # ([M, K], [N, K]) per layer
        totals["torch_ms"].append(scale * _median_ms(lambda: [F.linear(x, w) for x, w in pairs], reps))
        totals["transposed_ms"].append(scale * _median_ms(lambda: [transposed_linear(x, w) for x, w in pairs], reps))
    return {"rows": list(rows), **totals}


def choose(mode: str, models: list[nn.Module], device: torch.device) -> dict:
    """Set the models' linear layers to the product `mode` asks for (auto: the faster by `probe`,
    on a CPU); returns what was chosen and why, for a run's conditions."""
    if mode not in MODES:
        raise HarnessError(f"cpu_linear={mode} must be one of {', '.join(MODES)}")
    if device.type != "cpu":
        return {"mode": mode, "product": "torch", "why": f"{device.type}: torch's own product"}
    found = None
    if mode == "auto" and not _linears(models):
        product = "torch"
    elif mode == "auto":
        found = probe(models)
        faster = sum(found["transposed_ms"]) < MARGIN * sum(found["torch_ms"])
        product = "transposed" if faster else "torch"
    else:
        product = mode
    for layer in _linears(models):
        if hasattr(layer, "transposed_product"):
            layer.transposed_product = product == "transposed"
        else:
            layer.__class__ = TransposedLinear if product == "transposed" else nn.Linear
    return {"mode": mode, "product": product, **({"probe": found} if found else {})}
