"""Whether the process that launched this worker is still there (workers/heartbeat.py asks).

A worker started as a bare interpreter is its launcher's child: the launcher is gone when the
worker's parent changes. A fork of the warm template (workers/process/warm_start.py) is the template's
child, and the template may outlive the launcher for a moment or be stopped: such a worker
watches the launcher itself through a pidfd (`watch`), which turns readable when it ends.
"""

from __future__ import annotations

import os
import select

_launcher_fd: int | None = None
_lost = False  # the launcher had ended before `watch` could open it


def watch(launcher_pid: int) -> None:
    """Watch `launcher_pid` instead of the parent (a forked worker, before it starts)."""
    global _launcher_fd, _lost
    try:
        _launcher_fd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        _lost = True


def launcher_gone(parent_at_start: int) -> bool:
    """The launcher has ended: the watched process, else the parent the worker started under."""
    if _lost:
        return True
    if _launcher_fd is not None:
        return bool(select.select([_launcher_fd], [], [], 0)[0])
    return os.getppid() != parent_at_start
