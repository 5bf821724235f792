"""kill -9 of the prefill worker during a live disable of disaggregation, through `pdserve serve`
(default restarts, admin token from the environment). The worker's supervisor starts it again in
its launch role (prefill) under a new epoch; the disable must still end with it colocated, and
every incarnation must run under its own epoch (the handoff's fences and capabilities bind
epochs). Before: the disable answered 503 `role_change_failed` ("came back as prefill"), the
release said PINNED while prefill-0 stayed a prefill worker that no request reached, and posting
the disable again answered 200 and changed nothing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx

from tests.api.served_cli import serve_logged, stop, wait_healthy

TOKEN = "role-change-test"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _roles(base: str) -> dict[str, tuple[str, int, str]]:
    return {w["id"]: (w["role"], w["epoch"], w["state"]) for w in httpx.get(base + "/workers", timeout=10).json()}


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(what)


def _pools_free(base: str) -> bool:
    return all(w["load"]["free_blocks"] == w["load"]["num_blocks"] and w["load"]["reserved_blocks"] == 0
               for w in httpx.get(base + "/workers", timeout=10).json())


@contextlib.contextmanager
def _served(tmp_path, *flags: str):
    """(process, base URL, log path) of a 1P1D `pdserve serve` that disaggregates every request
    (so a stream holds prefill-0's drain), admin token from the environment."""
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, "--pd-decision", "always", *flags, env={"PDSERVE_ADMIN_TOKEN": TOKEN})
    try:
        wait_healthy(port, 180.0)
        yield proc, f"http://127.0.0.1:{port}", log_path
    finally:
        stop(proc)


def _kill_prefill_during_a_disable(proc, base: str):
    """Start a stream, post the disable (its drain waits for the stream), kill -9 prefill-0 while it
    drains; (the disable's answer, seconds from the kill to it, the stream's `data:` lines) once
    both ended. The stream is long enough to be still running when the drain is seen on any CPU."""
    tokens: list[str] = []
    body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": 1500, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as answer:
            tokens.extend(line for line in answer.iter_lines() if line.startswith("data: "))

    client = threading.Thread(target=stream)
    client.start()
    _until(lambda: len(tokens) >= 3, 60, "the stream did not start")
    answers: list[tuple[httpx.Response, float]] = []
    disable = threading.Thread(target=lambda: answers.append(
        (httpx.post(base + "/admin/disaggregation", json={"enabled": False}, headers=ADMIN, timeout=120),
         time.monotonic())))
    disable.start()
    _until(lambda: _roles(base)["prefill-0"][2] == "draining", 30, "prefill-0 did not drain")
    (pid,) = (int(p) for p in subprocess.run(["pgrep", "-x", "pd-prefill-0", "-g", str(proc.pid)],
                                             capture_output=True, text=True).stdout.split())
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    disable.join(120)
    client.join(120)
    ((answer, answered),) = answers
    return answer, answered - killed, tokens


def _cut(tokens: list[str]) -> bool:
    """Whether the stream ended otherwise than at its length with [DONE]."""
    chunks = [json.loads(line.removeprefix("data: ")) for line in tokens[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    return not (tokens[-1] == "data: [DONE]" and finishes[-1] == "length" and finishes.count("length") == 1
                and not any("error" in c for c in chunks))


def test_a_prefill_worker_killed_during_a_live_disable_still_ends_colocated_under_a_fresh_epoch(tmp_path):
    with _served(tmp_path) as (proc, base, log_path):
        assert _roles(base)["prefill-0"] == ("prefill", 1, "live")
        answer, _, tokens = _kill_prefill_during_a_disable(proc, base)
        assert answer.status_code == 200, answer.text
        assert answer.json()["state"] == "PINNED"
        roles = _roles(base)
        assert roles["prefill-0"][0::2] == ("colocated", "live") and roles["prefill-0"][1] >= 3, roles
        assert not _cut(tokens)
        again = httpx.post(base + "/admin/disaggregation", json={"enabled": False}, headers=ADMIN, timeout=120)
        assert again.status_code == 200 and again.json()["state"] == "PINNED"
        enabled = httpx.post(base + "/admin/disaggregation", json={"enabled": True}, headers=ADMIN, timeout=120)
        assert enabled.status_code == 200 and enabled.json()["state"] == "ACTIVE"
        assert _roles(base)["prefill-0"][0] == "prefill"
        after = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 8,
                                                            "ignore_eos": True}, timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
        _until(lambda: _pools_free(base), 30, "a worker still holds blocks")
    text = log_path.read_text()
    # each incarnation of prefill-0 announces itself once, with its epoch and role: epochs never repeat
    epochs = [int(e) for e in re.findall(r"pdserve worker prefill-0 \(epoch (\d+), ", text)]
    assert epochs == sorted(set(epochs)) and len(epochs) >= 3, epochs
    assert "Traceback" not in text, text[-3000:]


def test_a_prefill_worker_that_fails_for_good_during_a_disable_is_named_at_once_and_enable_is_refused(tmp_path):
    """--max-crashes 1: the kill -9 during the drain makes prefill-0 FAILED (never started again).
    The disable answers 503 at once naming it (not after waiting 30 s for a registration that never
    comes), the release is PINNED and the decode worker serves whole requests; enabling is refused
    with 503 and changes nothing; posting the disable again says the same. Before: 200 on the
    second disable and 200 ACTIVE on the enable, with no prefill worker left to serve."""
    with _served(tmp_path, "--max-crashes", "1") as (proc, base, _):
        answer, after_kill_s, tokens = _kill_prefill_during_a_disable(proc, base)
        assert answer.status_code == 503 and "prefill-0 is FAILED" in answer.text, answer.text
        assert after_kill_s < 20  # not the 30 s register wait
        assert not _cut(tokens)  # published on decode-0 before the kill: it finished there
        state = httpx.get(base + "/admin/state", headers=ADMIN, timeout=10).json()
        assert (state["state"], state["disaggregation"]) == ("PINNED", False)
        for enabled in (True, False):
            again = httpx.post(base + "/admin/disaggregation", json={"enabled": enabled}, headers=ADMIN, timeout=60)
            assert again.status_code == 503 and "prefill-0" in again.text and "FAILED" in again.text, again.text
        state = httpx.get(base + "/admin/state", headers=ADMIN, timeout=10).json()
        assert (state["state"], state["disaggregation"]) == ("PINNED", False)
        roles = _roles(base)
        assert roles["decode-0"] == ("decode", 1, "live") and roles["prefill-0"][2] == "failed", roles
        after = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 8,
                                                            "ignore_eos": True}, timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
        # the rollback completes: a worker that serves nothing needs no fallback role; it is named
        rolled = httpx.post(base + "/admin/rollback", headers=ADMIN, timeout=120)
        assert rolled.status_code == 200 and rolled.json()["state"] == "ROLLED_BACK", rolled.text
        steps = {step["name"]: step["detail"] for step in rolled.json()["steps"]}
        assert steps["ENABLE_COLOCATED_FALLBACK"] == {"role_changes": [], "failed": ["prefill-0"]}
