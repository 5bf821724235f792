"""A real `pdserve serve` process for tests of what only the CLI's server has (its event loop, its
HTTP edge's connection limits): started on a free port with the tiny model, one colocated
replica, ended with its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from pdserve.ports import free_local_port

ROOT = Path(__file__).resolve().parents[2]
TINY_SERVE = ("--model", "tiny", "--mode", "colocated", "--replicas", "1", "--kv-cache-mb", "16", "--no-restart")


@contextlib.contextmanager
def served_cli(*flags: str, ready_timeout_s: float = 120.0) -> Iterator[tuple[subprocess.Popen, int, str]]:
    """(process, port, its ready line) of `pdserve serve` with `flags`, answering /health."""
    port = free_local_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", *TINY_SERVE, "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        ready = ready_line(proc, ready_timeout_s)
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # a full pipe would stall the server
        wait_healthy(port, 60.0)  # the ready line comes just before uvicorn binds
        yield proc, port, ready
    finally:
        stop(proc)


def serve_logged(log_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """(process, port) of `pdserve serve --model tiny --kv-cache-mb 16` with `flags` (the rest its
    defaults: 1P1D), its output in `log_path`, in a session of its own (`stop` ends it), `env`
    added to this process's environment."""
    port = free_local_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--model", "tiny", "--kv-cache-mb", "16",
                                 "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, start_new_session=True)
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to its process group, SIGKILL past 30 s (uvicorn waits for open requests to end)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # it may have exited on a bad flag
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
            return


def ready_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    for line in proc.stdout:
        if "cluster ready" in line:
            return line
        seen.append(line)
        assert time.monotonic() < deadline, "pdserve serve did not become ready"
    raise AssertionError(f"pdserve serve exited ({proc.wait()}) before it was ready: {''.join(seen[-20:])}")


def wait_healthy(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("pdserve serve did not answer /health")
