"""Steps compiled once per shape: compile=true on the lean forward and the feature heads.

A captured step's shapes depend only on its rows and the positions each feeds (fixed storage capacity,
positions as a device tensor, finished rows fed as padding). `Captured` compiles it (CUDA graphs on a
GPU) at the first call of a shape, during warm-up; once sealed, a new shape is an error, never a
recompilation inside a timed run. `compiles()` counts dynamo's graphs, so a run records its recompiles.
"""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo.exc
import torch._inductor.exc

from harness.base.host_reads import unwatched
from harness.config.settings import COMPILED_MAX_TOKENS
from harness.errors import HarnessError


def allow_recompiles() -> None:
    """Room for every shape a sweep compiles, and running out an error rather than a silent fall back to eager."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name before torch 2.7
    setattr(config, limit, max(getattr(config, limit), 64 * COMPILED_MAX_TOKENS))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * getattr(config, limit))
    if hasattr(config, "fail_on_recompile_limit_hit") and not config.suppress_errors:  # torch refuses both at once
        config.fail_on_recompile_limit_hit = True


def runs_captured(captured: Captured | None, starts: list[int], counts: list[int], width: int) -> bool:
    """Whether a step runs captured: compiled, at most COMPILED_MAX_TOKENS positions, every row it feeds past
    its position 0 (a prompt's pass runs eagerly)."""
    return captured is not None and width <= COMPILED_MAX_TOKENS and all(s > 0 for s, c in zip(starts, counts) if c)


def room(length: int, captured: Captured | None) -> int:
    """Storage for `length` positions, compiled with room for a step's padding past the longest row (a captured step cannot grow it)."""
    return length + (COMPILED_MAX_TOKENS if captured is not None else 0)


def padded_rows(feed: torch.Tensor, rows: int) -> torch.Tensor:
    """feed [B, ...] with zero rows up to `rows` [rows, ...]: the finished rows of a captured batch."""
    pad = rows - feed.shape[0]
    return torch.nn.functional.pad(feed, (0, 0) * (feed.dim() - 1) + (0, pad)) if pad else feed


def compiles() -> int:
    """Graphs dynamo has compiled in this process so far (every compilation and recompilation)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class Captured:
    """fn compiled for fixed shapes, called as captured(key, *args), `key` naming the step's shape; after
    `warming()`, a key not met before raises."""

    def __init__(self, fn, name: str, device: torch.device):
        allow_recompiles()
        self.graphs = device.type == "cuda"
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead" if self.graphs else None)
        self.name, self.sealed = name, False
        self.inputs: dict[tuple, list] = {}  # per shape key: the tensors the compiled step reads its inputs from

    @torch.inference_mode()
    def __call__(self, key: tuple, *args):
        """fn(*args), its tensor arguments copied into this key's own inputs (fixed addresses, as CUDA graphs need)."""
        if key not in self.inputs:
            if self.sealed:
                raise HarnessError(
                    f"compile=true: the {self.name} met a step of shape {key} after warm-up, compiled only for "
                    f"{sorted(map(str, self.inputs))}; it would recompile inside the timed run: report this with the "
                    "command line, or run with compile=false"
                )
            self.inputs[key] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            try:  # the first call compiles: a machine without a working compiler is one line, not a traceback
                return self._run(self.inputs[key])
            except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InvalidCxxCompiler) as err:
                del self.inputs[key]
                reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
                raise HarnessError(
                    f"compile=true could not compile the {self.name} ({reason}): install a C++ compiler (CPU) or "
                    "Triton (GPU) that torch.compile can use, or run with compile=false"
                ) from err
        return self._run(self.inputs[key], args)

    def _run(self, inputs: list, given: tuple = ()):
        """The compiled step on this shape's own inputs, `given` copied into them first."""
        for mine, value in zip(inputs, given):
            if isinstance(mine, torch.Tensor):
                mine.copy_(value)
        if self.graphs:  # a CUDA graph's outputs live in buffers its next replay overwrites
            torch.compiler.cudagraph_mark_step_begin()
            return torch.utils._pytree.tree_map(torch.clone, unwatched(self.fn, *inputs))
        return unwatched(self.fn, *inputs)

    @contextlib.contextmanager
    def warming(self):
        """Within it every shape met compiles (outside any timing); after it, a new shape is an error."""
        self.sealed = False
        with torch.inference_mode():
            yield
        self.sealed = True
