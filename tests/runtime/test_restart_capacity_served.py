"""`pdserve serve --kv-cache-mb 6` (1P1D, the rest defaults), 30 streams at once, kill -9 of the
only decode worker while they stream (found by an adversarial pass).

Before: the requests it was serving waited for its restart, and were decided again as soon as it
registered; by then the requests waiting in admission had taken its fresh pool, so 3-8 of 30 ended
with `kv_not_visible` (some 70 ms after the kill, decided before the death was known); and a
request arriving as capacity freed took it ahead of those that had waited longest, which could run
out their admission wait (503). Now a request whose decode worker is lost waits for room at a live
one (`capacity_wait`) as well as for a restart, and admission is first come, first served: every
stream ends with its whole output, the tokens an unloaded server gives, and the pools come back.
(`--admission-wait-s 120`: the failures before were not admission timeouts; the longer wait keeps
the 30 queued requests from timing out on a slower machine.)"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx

from tests.api.served_cli import serve_logged, stop
from tests.runtime.test_kernel_threads_served import _until, _workers

N, MAX_TOKENS = 30, 200


def _body(i: int) -> dict:
    rng = random.Random(i)
    return {"model": "tiny", "prompt": [rng.randrange(3, 250) for _ in range(rng.randrange(40, 110))],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": 1000 + i, "return_token_ids": True}


def _complete(port: int, i: int, out: dict) -> None:
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=_body(i), timeout=300)
        out[i] = (r.status_code, r.json())
    except httpx.HTTPError as exc:
        out[i] = (0, repr(exc))


def test_streams_on_a_killed_decode_worker_all_finish_with_a_small_pool(tmp_path):
    log_path = tmp_path / "serve.log"
    # admission waits up to 120 s, not 30: a machine half as fast must not turn the queue of 30 into 503s
    proc, port = serve_logged(log_path, "--kv-cache-mb", "6", "--admission-wait-s", "120")
    try:
        first = _until(lambda: (w := _workers(port)) and len(w) == 2 and all(x["state"] == "live" for x in w.values())
                       and w, f"the server never came up: {log_path.read_text()[-3000:]}", 240.0)
        baseline = {wid: w["load"]["free_blocks"] for wid, w in first.items()}
        out: dict = {}
        clients = [threading.Thread(target=_complete, args=(port, i, out), daemon=True) for i in range(N)]
        for c in clients:
            c.start()
        _until(lambda: _workers(port)["decode-0"]["load"]["num_running"] >= 4, "decode-0 never ran the load", 60.0)
        os.kill(first["decode-0"]["pid"], signal.SIGKILL)
        for c in clients:
            c.join(300)
        failed = {i: r for i, r in out.items() if r[0] != 200 or "error" in r[1]}
        assert len(out) == N and failed == {}, failed
        assert all(len(r[1]["choices"][0]["token_ids"]) == MAX_TOKENS for r in out.values())
        _until(lambda: (w := _workers(port))["decode-0"]["epoch"] >= 2
               and {wid: x["load"]["free_blocks"] for wid, x in w.items()} == baseline, "the pools never came back", 60.0)
        for i in random.Random(0).sample(range(N), 6):  # the same tokens, one at a time on the idle server
            _complete(port, i, alone := {})
            assert alone[i][1]["choices"][0]["token_ids"] == out[i][1]["choices"][0]["token_ids"], i
    finally:
        stop(proc)
    assert "killed by SIGKILL" in log_path.read_text()
