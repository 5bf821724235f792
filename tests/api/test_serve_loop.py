"""`pdserve serve` runs its router and HTTP server on uvloop (pdserve/loop.py) and streams on it; that
process never loads torch (the engine lives in the workers, the cost-model fit in a child)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.api.served_cli import served_cli


def test_serve_cli_runs_on_uvloop_and_streams_without_torch_in_its_process():
    pytest.importorskip("uvloop")  # a declared dependency on Linux; pdserve falls back to asyncio without it
    with served_cli() as (proc, port, ready):
        assert "(uvloop loop)" in ready, ready
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


def _children(pid) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def _command(pid: str) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
