"""Stopping a real `pdserve serve` the way service managers do: SIGTERM to its whole process group
(systemd's default KillMode, `timeout`, `kill -- -PGID`), so the workers get it at the same time
as the server. The server must stop without starting workers again, say nothing alarming, and
leave no process or shared-memory segment behind. Before, each worker's death was logged as
"exited with code 255; restarting in 0.5 s" and each worker's resource tracker warned of "leaked
shared_memory objects", on every stop."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.api.served_cli import serve_logged, wait_healthy


def group_members(pgid: int) -> list[str]:
    """The processes still in the process group (ps: pid, pgid, command)."""
    rows = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout.splitlines()
    return [row for row in rows if row.split(None, 2)[1:2] == [str(pgid)]]


def segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_sigterm_to_the_process_group_stops_cleanly_without_restarts(tmp_path, mode):
    log_path = tmp_path / "serve.log"
    before = segments()
    proc, port = serve_logged(log_path, "--mode", mode)
    try:
        wait_healthy(port, 180.0)
        members = group_members(proc.pid)
        assert len(members) >= 3  # the server, its workers (and their warm-start template)
        pids = {row.split()[0] for row in members}
        ended: list[str] = []
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}

        def stream() -> None:  # open across the stop: it must end, whatever it says
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as answer:
                    ended.extend(line for line in answer.iter_lines() if line.startswith("data: "))
            except httpx.HTTPError as exc:
                ended.append(f"cut: {exc!r}")

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        deadline = time.monotonic() + 60
        while not ended and time.monotonic() < deadline:  # streaming: the workers are busy when the stop comes
            time.sleep(0.05)
        assert ended, "the stream never started"
        os.killpg(proc.pid, signal.SIGTERM)
        # uvicorn re-raises the signal it stopped on; 20 s bounds only "never": a request waiting for a
        # restarted worker (--admission-wait-s 30) held the stop before the stop ended such waits
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
        client.join(timeout=60)
        assert not client.is_alive(), "the open stream never ended"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 20
    while group_members(proc.pid) and time.monotonic() < deadline:  # workers exit once they see the server gone
        time.sleep(0.1)
    assert group_members(proc.pid) == []
    said = log_path.read_text()
    assert "restarting in" not in said and "FAILED" not in said, said[-3000:]
    assert "leaked shared_memory" not in said and "Traceback" not in said, said[-3000:]
    assert "(epoch 2" not in said, said[-3000:]  # no worker started again
    ours = {name for name in segments() - before if name.startswith("pdserve") and set(name.split("-")) & pids}
    assert not ours, ours  # pool segments are named after their worker's pid


def _worker_started(pgid: int) -> bool:
    rows = subprocess.run(["ps", "-eo", "pgid=,comm="], capture_output=True, text=True).stdout.splitlines()
    return any(row.split() == [str(pgid), "pd-prefill-0"] for row in rows)


def test_sigint_during_the_start_ends_the_server_as_signalled(tmp_path):
    """A Ctrl-C while the workers load (before the HTTP server takes the signals) reached `serve`
    as a KeyboardInterrupt, which it took for a normal end: exit status 0, as if it had served."""
    proc, _ = serve_logged(tmp_path / "serve.log", "--pd-profile", "none")
    try:
        deadline = time.monotonic() + 120
        while not _worker_started(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, "no worker started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == -signal.SIGINT
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
