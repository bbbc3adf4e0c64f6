"""Claims on cells: one process at a time runs a cell.

The cell key is deterministic, so two processes sharing a results store (one
W&B agent per GPU, SLURM array tasks) can pick the same cell; `claim` makes the
second wait for the first, which then finds the cell complete and skips it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLAIM_POLL_S = 5.0  # how often a waiting process looks at a claim again


@contextmanager
def claim(cell_dir: str | Path, poll_s: float | None = None, stale_s: float = 300.0, quiet: bool = False) -> Iterator[Path]:
    """Hold `<cell_dir>/.claim` (created with O_EXCL, holding host and pid) while running a cell.

    A claim whose holder is gone is taken over: on the same host when its pid
    is dead, on any host when its heartbeat (the file's mtime, touched every
    stale_s / 4 seconds) is older than stale_s.
    """
    path = Path(cell_dir) / ".claim"
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    waiting = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileNotFoundError:  # the holder's run stopped before writing anything and removed the empty cell
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        except FileExistsError:
            holder = _read_claim(path)
            if is_stale(path, holder, stale_s):
                if not quiet:
                    print(f"[harness] taking over a stale claim on {path.parent.name} ({_who(holder)})", file=sys.stderr)
                # Nobody took it over meanwhile: the same holder, still stale (a fresh claim another process
                # has just created and not yet written reads as empty too, but it is not old).
                if _read_claim(path) == holder and is_stale(path, holder, stale_s):
                    path.unlink(missing_ok=True)
                continue
            if not waiting and not quiet:
                print(f"[harness] cell {path.parent.name} is being run by {_who(holder)}; waiting for it", file=sys.stderr)
            waiting = True
            time.sleep(CLAIM_POLL_S if poll_s is None else poll_s)
            continue
        with os.fdopen(fd, "w") as out:
            json.dump(mine, out)
        break
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, stop, stale_s / 4), daemon=True)
    beat.start()
    try:
        yield path
    finally:
        stop.set()
        beat.join()
        if _read_claim(path) == mine:
            path.unlink(missing_ok=True)


def _read_claim(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # gone, or being written: look again on the next poll


def _who(holder: dict | None) -> str:
    return f"{holder.get('host')}:{holder.get('pid')}" if holder else "another process"


def is_stale(path: Path, holder: dict | None, stale_s: float) -> bool:
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False  # released meanwhile: the next O_EXCL try takes it
    if holder is None:
        return age > 10  # empty or torn: its writer died between creating and writing it
    if age > stale_s:
        return True
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError):
        return False
    return False


def _heartbeat(path: Path, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            os.utime(path)
        except OSError:
            return
