"""A prefix fetch whose holder is stopped (SIGSTOP, continued before the heartbeat timeout), through
a real `pdserve serve` process (2 colocated replicas, round robin: the second turn lands on the
worker without the history and fetches it).
- The client hangs up during the fetch: the router abandons it, so the destination's reservation
  and the holder's pins return at once, not when their leases expire; the request is counted as
  aborted with a trace line, and its fetch's result is counted.
- The client waits: the fetch as a whole (reserve, pin, serve, land) is abandoned at its one
  deadline, 2 s + 10x its prediction (router/kv/fetch_runner.py `MIN_DEADLINE_S`), and the
  request recomputes."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import time
import urllib.request

from pdserve.router.kv import fetch_runner
from tests.api.served_cli import served_cli

HISTORY = [random.Random(41).randrange(3, 256) for _ in range(1184)]  # 74 full blocks
LEASE_S = 30.0
FREE_WITHIN_S = 10.0  # only "never before the lease" fails this


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.read().decode()


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _complete(port: int, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    raise AssertionError(what)


def _pools(port: int) -> dict[str, tuple[int, int, int, int]]:
    """worker -> (free blocks, blocks, reserved blocks, device blocks in use: pinned ones too)."""
    return {w["id"]: (w["load"]["free_blocks"], w["load"]["num_blocks"], w["load"]["reserved_blocks"],
                      w["load"]["kv_tiers"]["device"]["used"]) for w in json.loads(_get(port, "/workers"))}


def _all_free(port: int) -> bool:
    return all(free == total and reserved == used == 0 for free, total, reserved, used in _pools(port).values())


def _streaming_client(port: int, prompt: list[int]) -> socket.socket:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True})
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock


def _trace(tmp_path) -> list[dict]:
    with open(tmp_path / "requests.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _history_held(port: int) -> dict:
    """Turn 1 (on the first worker), once the router's K/V index has its blocks: that worker."""
    assert _complete(port, HISTORY + [7])["usage"]["completion_tokens"] == 4
    _until(lambda: _metric(_get(port, "/metrics"), "pdserve_kv_index_entries") >= 74, 30, "history not indexed")
    return _until(lambda: next((w for w in json.loads(_get(port, "/workers"))
                                if w["load"]["kv_tiers"]["device"]["cached"] >= 74), None), 30, "no worker reports it")


def _served(tmp_path):
    return served_cli("--replicas", "2", "--policy", "round_robin", "--pd-profile", "none", "--lease-s", str(LEASE_S),
                      "--heartbeat-timeout-s", "30", "--trace-dir", str(tmp_path))


def test_a_client_gone_during_a_fetch_returns_both_sides_blocks_before_the_lease(tmp_path):
    with _served(tmp_path) as (_, port, _):
        holder = _history_held(port)
        os.kill(holder["pid"], signal.SIGSTOP)  # it cannot answer FetchPin: the fetch waits
        try:
            client = _streaming_client(port, HISTORY + [9, 10, 11])  # round robin: the other worker fetches
            dest = _until(lambda: next((w for w, (free, total, *_) in _pools(port).items() if free < total), None),
                          30, "the destination never reserved the fetch's blocks")
            assert dest != holder["id"]
            client.close()
            time.sleep(1.0)  # the router sees the hang-up (the holder is still stopped)
        finally:
            os.kill(holder["pid"], signal.SIGCONT)
        continued = time.monotonic()
        _until(lambda: _all_free(port), FREE_WITHIN_S, f"blocks still held {FREE_WITHIN_S} s after the holder "
               f"continued: {_pools(port)}")
        assert time.monotonic() - continued < LEASE_S
        metrics = _get(port, "/metrics")
        assert _metric(metrics, 'pdserve_requests_total{result="aborted"}') == 1
        assert _metric(metrics, 'pdserve_kv_fetches_total{result="abandoned"}') == 1
        assert _metric(metrics, 'pdserve_kv_fetches_total{result="landed"}') == 0
        lines = _trace(tmp_path)
        gone = [line for line in lines if line.get("prompt_tokens") == len(HISTORY) + 3]
        assert len(gone) == 1 and gone[0]["finish_reason"] == "abort", lines
        assert gone[0]["fetch"] == "fetch" and gone[0].get("fetch_failure") == "abandoned", gone
        assert _complete(port, HISTORY + [12])["usage"]["completion_tokens"] == 4  # the server answers as before


def test_a_hung_holder_costs_a_request_at_most_the_fetch_deadline(tmp_path):
    with _served(tmp_path) as (_, port, _):
        holder = _history_held(port)
        os.kill(holder["pid"], signal.SIGSTOP)  # it never answers FetchPin
        try:
            assert _complete(port, HISTORY + [9, 10, 11])["usage"]["completion_tokens"] == 4  # recomputed
        finally:
            os.kill(holder["pid"], signal.SIGCONT)
        line = _until(lambda: next((x for x in _trace(tmp_path) if x.get("prompt_tokens") == len(HISTORY) + 3), None),
                      10, f"no trace line: {_trace(tmp_path)}")
        assert (line["fetch"], line.get("fetch_failure"), line.get("fetch_landed_blocks")) == ("fetch", "timeout", 0), line
        deadline_s = fetch_runner.MIN_DEADLINE_S + 10 * line["fetch_predicted_s"]
        assert deadline_s <= line["fetch_s"] < deadline_s + 2.0, line  # 2.0: only a bound on "not abandoned then"
        assert _metric(_get(port, "/metrics"), 'pdserve_kv_fetches_total{result="failed"}') == 1
        _until(lambda: _all_free(port), FREE_WITHIN_S, f"blocks still held: {_pools(port)}")
