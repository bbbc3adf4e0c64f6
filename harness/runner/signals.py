"""SIGTERM ends a run as Ctrl-C does, except where submitit handles it.

A scheduler or `kill` sends SIGTERM; turned into KeyboardInterrupt, it ends a
cell the same way as Ctrl-C: status.json says interrupted, the claim is
released, the exit code is 130, and the next run resumes the cell.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


def submitit_handles_sigterm() -> bool:
    """In a submitit task (its environment variable set, and its own handler on SIGTERM): not in a
    process the task started, such as a `wandb agent`'s harness, which would then die unhandled."""
    handler = signal.getsignal(signal.SIGTERM)
    owner = getattr(getattr(handler, "__self__", None), "__class__", type(handler))
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and owner.__module__.startswith("submitit")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM (a scheduler or `kill`) like Ctrl-C, so both end a run the same way. Not in a
    submitit task (Hydra's SLURM launcher): submitit ignores SIGTERM on purpose, since SLURM sends it
    on preemption too, and requeues the task on its own signal (the cell then resumes). Not off the
    main thread either, where Python cannot install a signal handler."""
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
