"""SIGTERM ends a run as Ctrl-C does (status interrupted, claim released, exit code 130, resumable),
except where submitit handles it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


def submitit_handles_sigterm() -> bool:
    """In a submitit task (its variable set and its own handler on SIGTERM), not a process the task started."""
    handler = signal.getsignal(signal.SIGTERM)
    owner = getattr(getattr(handler, "__self__", None), "__class__", type(handler))
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and owner.__module__.startswith("submitit")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C. Not in a submitit task (it ignores SIGTERM, which SLURM sends on preemption,
    and requeues the task on its own signal), nor off the main thread (no signal handler there)."""
    if threading.current_thread() is not threading.main_thread() or submitit_handles_sigterm():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
