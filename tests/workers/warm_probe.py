"""A stand-in worker for tests/workers/process/test_warm_start.py: reports what a forked worker sees
(its environment, argv, parent, process name), says hello on stderr, then lives until its parent
goes, as a worker does (workers/heartbeat.py), or until $PROBE_LIFE_S passes; it holds a shared
memory segment meanwhile, as a worker holds its K/V pool."""

from __future__ import annotations

import json
import os
import sys
import time
from multiprocessing import shared_memory

from pdserve.workers import lifeline


def main(argv: list[str]) -> None:
    parent = os.getppid()
    segment = shared_memory.SharedMemory(create=True, size=4096)  # unlinked by this process's tracker when it dies
    with open(f"/proc/{os.getpid()}/comm") as f:
        comm = f.read().strip()
    report = {"config": argv[0], "flavour": os.environ.get("PROBE_FLAVOUR"),
              "pytest_test": os.environ.get("PYTEST_CURRENT_TEST"), "argv": sys.argv, "parent": parent,
              "comm": comm, "segment": segment.name, "torch_loaded": "torch" in sys.modules, "stdin": os.readlink("/proc/self/fd/0")}
    out = os.environ["PROBE_OUT"]
    with open(out + ".tmp", "w") as f:
        f.write(json.dumps(report))
    os.rename(out + ".tmp", out)
    print(f"probe {argv[0]} on stderr", file=sys.stderr, flush=True)
    deadline = time.monotonic() + float(os.environ.get("PROBE_LIFE_S", "60"))
    while not lifeline.launcher_gone(parent) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
