"""A worker's children held before it is ended (workers/process/children.py): a child that is
stopped outlives its parent's kill -9 (no SIGTERM or death signal acts on it), and the hold ends
it; the resource tracker is not held (it exits by itself and unlinks what it tracked)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from pdserve.workers.process import children
from tests.helpers.processes import exited as _gone

SLEEPER = "import time; time.sleep(60)"
PARENT = f"""
import subprocess, sys
kids = [subprocess.Popen([sys.executable, "-c", {SLEEPER!r}]),
        subprocess.Popen([sys.executable, "-c", "import multiprocessing.resource_tracker; " + {SLEEPER!r}])]
print(" ".join(str(k.pid) for k in kids), flush=True)
kids[0].wait()
"""


def _until_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not _gone(pid):
        time.sleep(0.02)
    return _gone(pid)


def test_a_held_child_stopped_when_its_parent_is_killed_is_ended_and_the_tracker_is_not_held():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child, tracker = (int(p) for p in parent.stdout.readline().split())
    try:
        os.kill(child, signal.SIGSTOP)
        held = children.hold(parent.pid)
        assert len(held) == 1  # the sleeper, not the tracker
        parent.kill()
        parent.wait()
        time.sleep(0.2)
        assert not _gone(child)  # stopped and orphaned: nothing else would end it
        children.kill_held(held)
        assert _until_gone(child)
        assert not _gone(tracker)
    finally:
        for pid in (child, tracker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
