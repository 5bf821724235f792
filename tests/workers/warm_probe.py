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


def _kernels() -> dict:
    """What the C kernels may do in this fork: open an OpenMP region (a stale pool would hang the
    call below, which splits its rows over torch's threads), and on how many threads."""
    import torch

    from pdserve.model import ckernel, glue, paged_decode
    torch.set_num_threads(int(os.environ["PROBE_KERNELS"]))
    x = torch.randn(64, 4096)
    out = glue.add_rms_norm(x, None, torch.ones(4096), 1e-6)
    return {"openmp_usable": ckernel.openmp_usable(), "openmp_built": paged_decode.openmp(),
            "glue_threads": glue._threads(*x.shape), "glue_ok": bool(torch.isfinite(out).all())}


def main(argv: list[str]) -> None:
    parent = os.getppid()
    segment = shared_memory.SharedMemory(create=True, size=4096)  # unlinked by this process's tracker when it dies
    with open(f"/proc/{os.getpid()}/comm") as f:
        comm = f.read().strip()
    report = {"config": argv[0], "flavour": os.environ.get("PROBE_FLAVOUR"),
              "pytest_test": os.environ.get("PYTEST_CURRENT_TEST"), "argv": sys.argv, "parent": parent,
              "comm": comm, "segment": segment.name, "torch_loaded": "torch" in sys.modules, "stdin": os.readlink("/proc/self/fd/0")}
    if os.environ.get("PROBE_KERNELS"):
        report.update(_kernels())
    out = os.environ["PROBE_OUT"]
    with open(out + ".tmp", "w") as f:
        f.write(json.dumps(report))
    os.rename(out + ".tmp", out)
    print(f"probe {argv[0]} on stderr", file=sys.stderr, flush=True)
    deadline = time.monotonic() + float(os.environ.get("PROBE_LIFE_S", "60"))
    while not lifeline.launcher_gone(parent) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
