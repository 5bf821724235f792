"""A worker killed (kill -9) while `pdserve serve` starts, before it registered. With restarts on
(the default) its supervisor starts it again and the server comes up and serves; with
`--no-restart` the start fails at once, naming the worker. Before, the supervisor only ran once
every worker had registered: the log said "restarting in 0.5 s", nothing was restarted, and the
start waited out its 180 s timeout ("1 of 2 workers registered in 180s")."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from tests.api.served_cli import serve_logged, stop


def _kill_when_started(pgid: int, name: str, timeout_s: float = 120.0) -> int:
    """SIGKILL the server's worker process named `name` (PR_SET_NAME) as soon as it exists."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-x", name, "-g", str(pgid)], capture_output=True, text=True).stdout.split()
        if found:
            os.kill(int(found[0]), signal.SIGKILL)
            return int(found[0])
        time.sleep(0.005)
    raise AssertionError(f"no {name} process appeared")


@pytest.mark.parametrize("restart", [True, False], ids=["restarts", "no-restart"])
def test_a_worker_killed_during_start_up_is_restarted_or_fails_the_start_at_once(tmp_path, restart):
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, *([] if restart else ["--no-restart"]))
    try:
        _kill_when_started(proc.pid, "pd-decode-0")
        deadline = time.monotonic() + 120
        healthy = False
        while time.monotonic() < deadline and proc.poll() is None and not healthy:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.1)
        text = log_path.read_text()
        assert "decode-0 (epoch 1) killed by SIGKILL" in text, text[-3000:]
        if restart:
            assert healthy, text[-3000:]
            workers = {w["id"]: (w["epoch"], w["state"]) for w in httpx.get(f"http://127.0.0.1:{port}/workers").json()}
            assert workers == {"prefill-0": (1, "live"), "decode-0": (2, "live")}
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": "hello", "max_tokens": 6, "ignore_eos": True})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
        else:
            assert proc.wait(30) == 1  # well inside the 180 s start-up timeout
            text = log_path.read_text()
            assert "error: decode-0 died during start-up and will not be started again (--no-restart" in text, text
            assert "Traceback" not in text, text
    finally:
        stop(proc)


def test_a_worker_stopped_during_start_up_fails_the_start_at_its_timeout_naming_it(tmp_path):
    """SIGSTOP before it registers: no heartbeat to miss and no death to see, so the start waits
    --startup-timeout-s and then fails naming the worker that did not register (before: "1 of 2
    workers registered in 180s", with no name and no flag to shorten the wait)."""
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, "--startup-timeout-s", "8")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = subprocess.run(["pgrep", "-x", "pd-prefill-0", "-g", str(proc.pid)], capture_output=True,
                                   text=True).stdout.split()
            if found:
                os.kill(int(found[0]), signal.SIGSTOP)
                break
            time.sleep(0.005)
        assert proc.wait(60) == 1
        text = log_path.read_text()
        # prefill-0 is named; on a loaded CPU decode-0 may be named beside it
        named = re.search(r"error: ([\w, -]+) did not register within 8 s of the start \(--startup-timeout-s\)", text)
        assert named and "prefill-0" in named.group(1).split(", "), text[-2000:]
        assert "Traceback" not in text, text[-3000:]
    finally:
        stop(proc)
