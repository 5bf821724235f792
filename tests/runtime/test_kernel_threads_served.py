"""`pdserve serve --threads-per-worker 2`, its other flags the defaults: every worker's C kernels
(attention, glue, few-row products) split a call over its 2 threads, at the first start and after
a kill -9 and restart alike (`/workers` `cpu.kernel_threads`, the workers' start lines). Before,
each worker forked from the warm template took itself for the child of a process whose OpenMP pool
was in use and ran every kernel on one thread, whatever the flag: decode steps of 8 rows took 1.6x
as long on the 107M checkpoint (docs/serving_vs_vllm.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from pdserve.model import paged_decode
from tests.api.served_cli import serve_logged, stop


def _workers(port: int) -> dict[str, dict]:
    return {w["id"]: w for w in httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()}


def _until(check, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(what)


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_every_worker_runs_its_kernels_on_its_threads_first_start_and_restart(tmp_path, start):
    """Forks of the warm template (the default) and bare interpreters (`PDSERVE_WORKER_START=exec`)
    alike; both are named pd-WORKER for `pgrep` (before, a bare interpreter stayed `python`)."""
    expected = 2 if paged_decode.openmp() else 1  # a build without OpenMP runs each call on one thread
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, "--threads-per-worker", "2", env={"PDSERVE_WORKER_START": start})
    try:
        first = _until(lambda: (w := _workers(port)) and set(w) == {"prefill-0", "decode-0"}
                       and all(x["state"] == "live" for x in w.values()) and w,
                       f"the server never came up: {log_path.read_text()[-3000:]}")
        assert {i: w["cpu"]["kernel_threads"] for i, w in first.items()} == {"prefill-0": expected, "decode-0": expected}
        victim = subprocess.run(["pgrep", "-x", "pd-decode-0", "-g", str(proc.pid)], capture_output=True,
                                text=True).stdout.split()
        os.kill(int(victim[0]), signal.SIGKILL)
        again = _until(lambda: (w := _workers(port)) and (w.get("decode-0", {}).get("epoch"), w.get("decode-0", {}).get("state"))
                       == (2, "live") and w, f"decode-0 was not restarted: {log_path.read_text()[-3000:]}")
        assert again["decode-0"]["cpu"]["kernel_threads"] == expected
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "hello", "max_tokens": 6, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
        lines = [line for line in log_path.read_text().splitlines() if line.startswith("pdserve worker ")]
        assert len(lines) == 3 and all(line.endswith(f"; C kernel threads {expected}")
                                       for line in lines), lines
    finally:
        stop(proc)
