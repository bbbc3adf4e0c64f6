"""Host reads of tensor values: what would make the host wait for a GPU.

On CUDA, `torch.cuda.set_sync_debug_mode` reports every synchronisation, but
only on a GPU. `HostReads` finds the same places on any device: it watches,
through a torch function mode, the Python-level operations that must bring a
tensor's value to the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`,
`nonzero`, a boolean-mask index, ...) and counts them by the source line that
asked, our code or the model's. It does not see a synchronisation made inside
a C++ kernel, so on a GPU the debug mode stays the authority; on a CPU it is
what lets a test hold the loop to its promise of no host wait per drafted token.
Nor does it look inside a compiled step (`unwatched`).
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
READS_TO_HOST = frozenset({
    _T.item, _T.tolist, _T.numpy, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
    _T.nonzero, torch.nonzero, _T.masked_select, torch.masked_select, _T.unique, torch.unique,
    _T.equal, torch.equal,
})  # `if t.any():` reads through __bool__; t.any() alone stays on the device
_TORCH_DIR = str(Path(torch.__file__).parent)


def _caller() -> str:
    """file:line of the innermost frame outside torch (the code that asked for the value)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            parts = Path(frame.filename).parts
            short = "/".join(parts[-2:]) if len(parts) > 1 else frame.filename
            return f"{short}:{frame.lineno}"
    return "?"


def _bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values by call site while active:
    `with HostReads() as reads: ...; reads.sites` -> Counter({"harness/rule.py:72": 40, ...})."""

    def __init__(self):
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = func in READS_TO_HOST or (func is _T.__getitem__ and len(args) > 1 and _bool_mask(args[1]))
        if reads:
            self.sites[_caller()] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def unwatched(fn, *args, **kwargs):
    """fn(*args, **kwargs) with an active HostReads set aside while it runs: for a
    compiled step. Dynamo guards on the torch function modes, so a step called
    under one would compile anew (for CUDA graphs, minutes); its reads, if any,
    are left to the CUDA debug mode."""
    if not isinstance(torch.overrides._get_current_function_mode(), HostReads):
        return fn(*args, **kwargs)
    with torch.overrides._pop_mode_temporarily():
        return fn(*args, **kwargs)
