"""`pdserve serve` runs its router and HTTP server on uvloop (pdserve/loop.py) and streams on it; that
process never loads torch (the engine lives in the workers, the cost-model fit in a child)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.ports import free_local_port

ROOT = Path(__file__).resolve().parents[2]


def test_serve_cli_runs_on_uvloop_and_streams_without_torch_in_its_process():
    pytest.importorskip("uvloop")  # a declared dependency on Linux; pdserve falls back to asyncio without it
    port = free_local_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--model", "tiny", "--mode", "colocated",
                             "--replicas", "1", "--kv-cache-mb", "16", "--port", str(port), "--no-restart"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        ready = _ready_line(proc, 120.0)
        assert "(uvloop loop)" in ready, ready
        _wait_healthy(port, 60.0)  # the ready line comes just before uvicorn binds
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True, "ignore_eos": True})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            events = [line for line in response.read().decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
        assert "cpu=" in ready  # the workers' CPU report, formatted here
        mapped = Path(f"/proc/{proc.pid}/maps").read_text()
        children = _children(proc.pid)  # the fit's child is gone: the workers' template and multiprocessing's
        commands = {c: _command(c) for c in children}  # resource tracker remain (workers/process/warm_start.py)
        templates = [c for c, cmd in commands.items() if "forkserver" in cmd]
        assert len(children) == 2 and len(templates) == 1 and any("resource_tracker" in c for c in commands.values()), commands
        workers = _children(templates[0])  # the one replica, a fork of the template
        assert len(workers) == 1 and "libtorch" in Path(f"/proc/{workers[0]}/maps").read_text()
        assert "libtorch" not in mapped
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _children(pid) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def _command(pid: str) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _ready_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if "cluster ready" in line:
            return line
        assert time.monotonic() < deadline, "pdserve serve did not become ready"
    raise AssertionError(f"pdserve serve exited ({proc.wait()}) before it was ready")


def _wait_healthy(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("pdserve serve did not answer /health")
