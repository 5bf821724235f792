"""A worker's child processes, held so that the launcher can end them after the worker.

Why: a worker's tensor-parallel followers die with it by `PR_SET_PDEATHSIG` (pdserve/lifetime.py),
but one stopped (SIGSTOP) in the interpreter start that precedes its prctl never sets it, and
once the worker is gone it is nobody's child: only a hold taken while the worker lived finds it.

Contract: `hold(pid)` opens a pidfd on every live child of `pid` except its resource tracker
(multiprocessing's, which exits by itself once the worker and its followers have, and unlinks
the shared memory they registered): take it before signalling the worker. `kill_held(held)`
SIGKILLs those still running (SIGKILL ends a stopped process too) and closes the pidfds. A pidfd
names the process itself, so a pid reused after a child's exit is never signalled. Without
pidfds (Linux before 5.3) `hold` holds nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal

TRACKER = b"multiprocessing.resource_tracker"  # in the tracker's command line (python -c 'from ... import main')


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_tracker(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return TRACKER in f.read()
    except OSError:
        return False


def hold(pid: int) -> list[int]:
    """pidfds of `pid`'s live children but its resource tracker (module contract)."""
    if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"):
        return []
    held = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _parent(entry) != pid or _is_tracker(entry):
            continue
        try:
            fd = os.pidfd_open(int(entry))
        except OSError:  # ended meanwhile
            continue
        if _parent(entry) == pid:  # still the child it was when listed, not a reuse of its pid
            held.append(fd)
        else:
            os.close(fd)
    return held


def kill_held(held: list[int]) -> None:
    """SIGKILL each held process that is still running; close the pidfds."""
    for fd in held:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)
