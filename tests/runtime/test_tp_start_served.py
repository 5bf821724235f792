"""A tensor-parallel follower rank lost during `pdserve serve --tp 2`'s start, before it joins its
group (found by an adversarial pass: decode-0's follower signalled as soon as it was spawned).

- Killed (kill -9): rank 0 waited in the join (up to 300 s, a TCPStore) and the server said
  nothing until its start-up timeout. Now rank 0 watches its followers while it joins: the start
  of that worker fails at once, its log line naming the rank and how it ended, and the worker is
  restarted like any worker that dies during start-up (or, with `--no-restart`, the start fails).
- Stopped while it imported torch, then rank 0 killed -9 (not by the server): the follower asked
  for PR_SET_PDEATHSIG only after its imports, so it lived on. Now it asks before them.
- Stopped (SIGSTOP): it cannot be told from a slow rank, so the start waits out
  `--startup-timeout-s`; but after the server exited, the stopped follower (it had not yet asked
  for PR_SET_PDEATHSIG: it was importing torch) and the worker's resource tracker lived on. Now no
  process of the server's process group and no shared-memory segment of its workers remains."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.api.served_cli import serve_logged, stop
from tests.runtime.test_kernel_threads_served import _until, _workers
from tests.runtime.test_stuck_worker_served import _children, _gone, _segments

TP_START = ("--tp", "2", "--pd-profile", "none")  # no cost-model fit: it spawns a TP group of its own


def _named(pgid: int, name: str) -> list[int]:
    found = subprocess.run(["pgrep", "-x", name, "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def _spawned(worker: int) -> int | None:
    for child in _children(worker):
        with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as f:
            if b"multiprocessing.spawn import spawn_main" in f.read():
                return child
    return None


def _first_follower(pgid: int, name: str, timeout_s: float = 120.0) -> tuple[int, int]:
    """(worker pid, follower pid) of the server's worker `name`, as soon as its follower exists."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in _named(pgid, name):
            follower = _spawned(worker)
            if follower is not None:
                return worker, follower
        time.sleep(0.005)
    raise AssertionError(f"no follower of {name} appeared")


def _mapped(pid: int, library: bytes) -> bool:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", "rb") as f:
        return library in f.read()
    return False


def _group(pgid: int) -> dict[int, str]:
    """pid -> state of every live process in process group `pgid`."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
                if int(pgrp) == pgid and state != "Z":
                    found[int(entry)] = state
    return found


@pytest.mark.parametrize("restart", [True, False], ids=["restarts", "no-restart"])
def test_a_follower_killed_before_it_joins_ends_that_start_at_once(tmp_path, restart):
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, *TP_START, "--startup-timeout-s", "120", *([] if restart else ["--no-restart"]))
    try:
        _, follower = _first_follower(proc.pid, "pd-decode-0")
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        line = f"pdserve worker decode-0: error: tensor-parallel rank 1 (pid {follower}) killed by SIGKILL before"
        _until(lambda: line in log_path.read_text() or proc.poll() is not None,
               f"rank 0 did not notice its lost follower: {log_path.read_text()[-3000:]}", 60.0)
        text = log_path.read_text()
        assert line in text and time.monotonic() - killed < 60, text[-3000:]  # not the 120 s start-up timeout
        _until(lambda: "decode-0 (epoch 1) exited with code 1" in log_path.read_text(),  # and the worker's exit
               f"decode-0 did not exit: {log_path.read_text()[-3000:]}", 30.0)
        if restart:
            workers = _until(lambda: (w := _workers(port)) and len(w) == 2 and all(x["state"] == "live" for x in w.values())
                             and w, f"the server never came up: {log_path.read_text()[-3000:]}", 120.0)
            assert {wid: w["epoch"] for wid, w in workers.items()} == {"prefill-0": 1, "decode-0": 2}
            assert _spawned(workers["decode-0"]["pid"]) is not None  # the new incarnation's follower
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": "hello", "max_tokens": 6, "ignore_eos": True})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
        else:
            assert proc.wait(30) == 1
            text = log_path.read_text()
            assert "error: decode-0 died during start-up and will not be started again (--no-restart" in text, text
        assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]
    finally:
        stop(proc)


def test_a_follower_stopped_before_it_joins_outlives_nothing(tmp_path):
    log_path = tmp_path / "serve.log"
    proc, _ = serve_logged(log_path, *TP_START, "--startup-timeout-s", "20")
    try:
        decode, follower = _first_follower(proc.pid, "pd-decode-0")
        os.kill(follower, signal.SIGSTOP)
        workers = {decode, *_named(proc.pid, "pd-prefill-0")}
        assert proc.wait(90) == 1
        text = log_path.read_text()
        # decode-0 is named (on a slow machine prefill-0 may be named beside it: its start is timed too)
        said = [line for line in text.splitlines() if "did not register within 20 s of the start (--startup-timeout-s)" in line]
        assert said and "decode-0" in said[0].split(" did not register")[0], text[-3000:]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _group(proc.pid):
            time.sleep(0.1)
        assert _group(proc.pid) == {}, f"outlived the server (pid: state): {_group(proc.pid)}"
        assert _gone(follower)
        assert not {n for n in _segments() if any(f"-{pid}-" in n for pid in workers)}
    finally:
        stop(proc)
        for pid in _group(proc.pid):  # what a failure left: continued, then ended
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)


def test_a_follower_stopped_while_it_imports_torch_dies_with_its_killed_rank_0(tmp_path):
    log_path = tmp_path / "serve.log"
    proc, _ = serve_logged(log_path, *TP_START)
    follower = None
    try:
        decode, follower = _first_follower(proc.pid, "pd-decode-0")
        _until(lambda: _mapped(follower, b"libtorch"), "the follower never mapped torch", 60.0)
        os.kill(follower, signal.SIGSTOP)
        os.kill(decode, signal.SIGKILL)  # someone else's kill -9: the server does not end this one
        _until(lambda: _gone(follower), "the stopped follower outlived its rank 0", 10.0)
    finally:
        stop(proc)
        if follower is not None and not _gone(follower):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(follower, sig)
