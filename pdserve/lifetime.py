"""How a child process's life is tied to its parent's, and how a process's end reads.

Contract:
- `die_with_parent(parent_pid)`: the kernel sends this process SIGKILL when the thread that
  started it ends (Linux `PR_SET_PDEATHSIG`; SIGKILL also ends a stopped process, which takes no
  SIGTERM until continued); if that parent is already gone (it died before the prctl, so no
  signal would come), the process exits at once with code 1.
- `run_tied(parent_pid, entry, payload)`: a `multiprocessing` target that calls `die_with_parent`
  before anything else, then imports `entry` ("module:function") and calls it with the
  arguments pickled in `payload`. A spawned child unpickles its target and arguments before it
  runs a line of it; with torch's modules behind them that takes seconds, during which its
  parent's death would leave it behind. Here they are this module and bytes, so the untied span
  is the interpreter's start (tens of milliseconds).
- `describe_exit(returncode)`: a return code in words ("killed by SIGKILL", "exited with code 1").
This module imports the standard library only: a spawned child imports it first.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the thread that started this process ends (its parent killed -9 included)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:  # gone before the prctl: no signal would come
        os._exit(1)


def run_tied(parent_pid: int, entry: str, payload: bytes) -> None:
    """Tie this process to `parent_pid`, then run `entry(*pickle.loads(payload))`."""
    die_with_parent(parent_pid)
    module, function = entry.split(":")
    getattr(importlib.import_module(module), function)(*pickle.loads(payload))


def describe_exit(returncode: int | None) -> str:
    """A process's return code in words: 'killed by SIGKILL', 'exited with code 1'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"
