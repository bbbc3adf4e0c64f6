"""Host reads of tensor values: what would make the host wait for a GPU.

`HostReads` watches, through a torch function mode, the operations that bring a tensor's value to the
host (`.item()`, `int(t)`, `.tolist()`, `nonzero`, a mask index, ...) and counts them by the source line
that asked, on any device. It does not see reads inside C++ kernels, torch's own Python functions or
compiled steps (`unwatched`): on a GPU torch.cuda.set_sync_debug_mode stays the authority.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

try:  # private helpers (torch 2.x): without them `unwatched` leaves the modes as they are
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode
except ImportError:  # pragma: no cover
    _get_current_function_mode_stack = None

_T = torch.Tensor
# Tensor methods that bring values to the host (`if t.any():` reads through __bool__; t.any() alone stays on the
# device), and those that are torch functions too (nonzero, unique...: output sizes from the values).
_METHODS = "item tolist numpy __bool__ __int__ __float__ __index__ __repr__ __format__ cpu __contains__".split()
_BOTH = "nonzero masked_select unique equal allclose is_nonzero bincount unique_consecutive".split()
READS_TO_HOST = frozenset(
    [getattr(_T, name) for name in _METHODS + _BOTH] + [getattr(torch, name) for name in _BOTH + ["argwhere"]]
)
_FROM_HOST = frozenset({torch.tensor, torch.as_tensor, _T.new_tensor})  # Python data copied to a device: the host waits
_TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
_PACKAGE = Path(__file__).resolve().parents[1]  # harness/


def _caller() -> str:
    """file:line of the innermost frame outside torch (the code that asked for the value)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            path = Path(frame.filename)
            inside = path.is_relative_to(_PACKAGE)  # ours: harness/core/loop.py; a library's: its last two parts
            short = f"harness/{path.relative_to(_PACKAGE).as_posix()}" if inside else "/".join(path.parts[-2:])
            return f"{short}:{frame.lineno}"
    return "?"


def _reads_index(index) -> bool:
    """An index that needs values on the host: a mask (its count of True), or a tensor scalar or bound."""
    items = index if isinstance(index, tuple) else (index,)
    bounds = [b for item in items if isinstance(item, slice) for b in (item.start, item.stop, item.step)]
    masks = [t for t in items if isinstance(t, torch.Tensor) and (t.dtype in (torch.bool, torch.uint8) or t.dim() == 0)]
    return bool(masks) or any(isinstance(b, torch.Tensor) for b in bounds)


def _to_host(args, kwargs) -> bool:
    """Tensor.to(...) from a GPU to the CPU (on a CPU run `.to(device)` is no read; `.cpu()` always counts)."""
    if not args or args[0].device.type == "cpu":
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets if t is not None)


def _is_read(func, args, kwargs) -> bool:
    if func in READS_TO_HOST:
        return True
    if func in (_T.__getitem__, _T.__setitem__):
        return len(args) > 1 and _reads_index(args[1])
    if func is _T.to:
        return _to_host(args, kwargs)
    if func is torch.nn.functional.one_hot:  # without num_classes, the class count is the values' max
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return classes == -1
    if func in _FROM_HOST:
        data = args[1:2] if func is _T.new_tensor else args[:1]  # (self, data) or (data)
        if data and isinstance(data[0], torch.Tensor):  # a tensor already somewhere: no Python data to copy from the host
            return False
        device = kwargs.get("device")
        if device is None and func is _T.new_tensor and args:
            device = args[0].device
        return device is not None and torch.device(device).type != "cpu"
    if func is torch.where:  # torch.where(mask) alone is nonzero
        return len(args) + len(kwargs) == 1
    if func in (torch.repeat_interleave, _T.repeat_interleave):  # tensor repeats: the output size
        alone = args[0] if args and func is torch.repeat_interleave else None  # torch.repeat_interleave(repeats)
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", alone)
        return isinstance(repeats, torch.Tensor) and "output_size" not in kwargs
    return False


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values by call site while active:
    `with HostReads() as reads: ...; reads.sites` -> Counter({"harness/core/rule.py:72": 40, ...})."""

    def __init__(self):
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_read(func, args, kwargs):
            self.sites[_caller()] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def unwatched(fn, *args, **kwargs):
    """fn(*args, **kwargs) with any active HostReads set aside (other modes stay, in order): for a compiled step,
    which dynamo would compile anew under a mode it was not compiled with."""
    stack = _get_current_function_mode_stack() if _get_current_function_mode_stack else []
    others = [mode for mode in stack if not isinstance(mode, HostReads)]
    if len(others) == len(stack):
        return fn(*args, **kwargs)
    for _ in stack:
        _pop_mode()
    for mode in others:
        _push_mode(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        for _ in others:
            _pop_mode()
        for mode in stack:
            _push_mode(mode)


def from_host(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of host values on `device` without waiting for its queue (CUDA: pinned memory, copied async)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
