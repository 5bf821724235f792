"""A worker that is alive but makes no progress, and a server stopped while a worker is stopped,
through `pdserve serve` (found by an adversarial pass).

- `--tp 2`, a follower rank of decode-0 SIGSTOPped mid-stream: rank 0 waits in a collective for
  good, but its heartbeat thread went on beating, so the router never retired it and every request
  there hung. Now the heartbeats stop once the worker's loop has not come round for
  `--step-timeout-s` (60 s by default, vLLM's iteration timeout; 3 s here), the router retires it as
  hung after `--heartbeat-timeout-s` (10 s by default; 3 s here), ends it (its ranks die with it) and starts it again; the
  stream ends and new requests are served.
- Default 1P1D, prefill-0 SIGSTOPped, then SIGTERM to the server: uvicorn re-raised the signal as
  its server returned, ending the process before the workers were stopped, so the stopped worker
  and its shared-memory pool outlived the server (only the worker's own check of its parent would
  have ended it). Now the server stops its workers (continuing a stopped one), unlinks what a
  killed one left, and then exits as signalled."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.api.served_cli import serve_logged, stop
from tests.helpers.processes import exited as _gone
from tests.runtime.conftest import prompt
from tests.runtime.test_kernel_threads_served import _until, _workers


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    return [c for child in _children(pid) for c in (child, *_tree(child))]


def _follower(worker_pid: int) -> int:
    """The worker's TP follower rank: the child spawned by multiprocessing (not its resource tracker)."""
    for child in _children(worker_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"multiprocessing.spawn import spawn_main" in cmdline:
            return child
    raise AssertionError(f"no follower rank under {worker_pid}")


def _stream(port: int, ended: dict) -> None:
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=httpx.Timeout(120, connect=10),
                          json={"model": "tiny", "prompt": list(prompt(60, 1)), "max_tokens": 250, "ignore_eos": True,
                                "stream": True}) as response:
            for line in response.iter_lines():
                ended.setdefault("first", time.monotonic())
                ended["done"] = line == "data: [DONE]" or ended.get("done", False)
    except httpx.HTTPError as exc:
        ended["error"] = repr(exc)
    ended["at"] = time.monotonic()


def test_a_stopped_tp_rank_gets_its_worker_replaced(tmp_path):
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, "--tp", "2", "--step-timeout-s", "3", "--heartbeat-timeout-s", "3",
                              "--pd-profile", "none")  # the TP cost-model fit is not what this tests
    try:
        first = _until(lambda: (w := _workers(port)) and len(w) == 2 and all(x["state"] == "live" for x in w.values())
                       and w, f"the server never came up: {log_path.read_text()[-3000:]}", 240.0)
        follower = _follower(first["decode-0"]["pid"])
        ended: dict = {}
        streaming = threading.Thread(target=_stream, args=(port, ended), daemon=True)
        streaming.start()
        _until(lambda: "first" in ended, "the stream never started", 60.0)
        os.kill(follower, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _until(lambda: (w := _workers(port)).get("decode-0", {}).get("epoch", 1) >= 2
               and w["decode-0"]["state"] == "live", f"decode-0 was never replaced: {log_path.read_text()[-3000:]}", 90.0)
        assert _gone(follower)  # SIGKILLed with its rank 0, stopped as it was
        streaming.join(90.0)
        assert not streaming.is_alive() and ended["at"] - stopped_at < 90.0, ended  # the stream ended, no hang
        assert ended.get("done"), ended  # recovered on the new incarnation (recompute), not failed
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": list(prompt(30, 2)), "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert "heartbeats stop so that the router replaces this worker" in log_path.read_text()
    finally:
        stop(proc)


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdserve-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("second", [None, signal.SIGTERM, signal.SIGINT], ids=["one signal", "SIGTERM twice",
                                                                                "then SIGINT"])
def test_sigterm_ends_a_stopped_worker_and_its_pool(tmp_path, second):
    """A second signal during the stop (a second Ctrl-C, a supervisor's repeat) ends the process at
    once, as before, but kills the workers first (before, the stopped ones were left behind)."""
    log_path: Path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path)
    tree: list[int] = []
    try:
        workers = _until(lambda: (w := _workers(port)) and len(w) == 2 and all(x["state"] == "live" for x in w.values())
                         and w, f"the server never came up: {log_path.read_text()[-3000:]}", 240.0)
        tree = _tree(proc.pid)
        pids = {workers[w]["pid"] for w in ("prefill-0", "decode-0")}
        pools = {n for n in _segments() if any(f"-{pid}-" in n for pid in pids)}
        assert pools
        for wid in ("prefill-0", "decode-0") if second else ("prefill-0",):
            os.kill(workers[wid]["pid"], signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)  # the server alone, as a user's kill or Ctrl-C does
        if second is not None:
            time.sleep(0.5)  # the stop is waiting for the stopped workers
            proc.send_signal(second)
        assert proc.wait(60) == -(second or signal.SIGTERM)  # it still exits as signalled
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_gone(p) for p in tree):
            time.sleep(0.1)
        assert [p for p in tree if not _gone(p)] == []
        assert pools.isdisjoint(_segments())
    finally:
        for pid in tree:  # what a failure left: continued, then ended
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        stop(proc)
