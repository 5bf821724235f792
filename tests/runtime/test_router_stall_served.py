"""A `pdserve serve` process stopped (SIGSTOP) past the heartbeat timeout and continued: the time
it did not run is not its workers' silence (router/process/frontend_upkeep.py `watchdog`,
router.excuse_stall), so no worker is retired as hung, killed and restarted, and the server
answers as before. The real trigger: the server's own process is stopped, its workers are not."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

from tests.api.served_cli import served_cli


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.read().decode()


def _complete(port: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_a_stopped_server_does_not_retire_its_workers_for_the_time_it_did_not_run():
    with served_cli("--heartbeat-timeout-s", "2") as (proc, port, _):
        before = {w["id"]: (w["pid"], w["epoch"]) for w in json.loads(_get(port, "/workers"))}
        assert before and _complete(port)["usage"]["completion_tokens"] == 4
        os.kill(proc.pid, signal.SIGSTOP)  # the server alone: its workers keep running and sending heartbeats
        try:
            time.sleep(5)  # 2.5 x the heartbeat timeout
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.5)  # several watchdog passes after the server runs again
        after = json.loads(_get(port, "/workers"))
        assert {w["id"]: (w["pid"], w["epoch"]) for w in after} == before
        assert all(w["state"] == "live" for w in after), after
        assert "pdserve_hung_workers_total 0.0" in _get(port, "/metrics")
        assert _complete(port)["usage"]["completion_tokens"] == 4
