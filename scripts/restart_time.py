"""Seconds from a worker's kill -9 until its replacement serves, per way of starting workers.

    python scripts/restart_time.py [--kills 3] [--modes fork,exec]

For each mode (`PDSERVE_WORKER_START`: "fork", the warm template, the default; "exec", a bare
interpreter per worker) it starts `pdserve serve` with its defaults (1 prefill + 1 decode, the
`tiny` model) `--kills` times, kills its decode worker with SIGKILL, and times the kill until
`/workers` lists decode-0 live under a newer epoch and a request completes. The restart backoff
(0.5 s at first) is inside every figure. Prints one JSON line per mode: the times and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

WORKER = "decode-0"


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _complete(base: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        json.loads(response.read())


def _worker(base: str) -> dict | None:
    views = _get(f"{base}/workers")
    views = views.get("workers", views) if isinstance(views, dict) else views
    return next((w for w in views if w.get("id") == WORKER), None)


def _pid(serve_pid: int) -> int:
    """The decode worker's pid: a descendant of the server named pd-decode-0 (a fork) or running
    with decode-0's config on its command line (a bare interpreter)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,comm=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    children: dict[int, list] = {}
    for row in rows:
        children.setdefault(int(row[1]), []).append(row)
    todo, found = [serve_pid], []
    while todo:
        for row in children.get(todo.pop(), []):
            todo.append(int(row[0]))
            args = row[3] if len(row) > 3 else ""
            if row[2] == f"pd-{WORKER}" or (f'"{WORKER}"' in args and "pdserve.workers.main" in args):
                found.append(int(row[0]))
    if len(found) != 1:
        raise RuntimeError(f"expected one {WORKER} process, found {found}")
    return found[0]


def _wait(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not get there in time")
        time.sleep(0.02)


def kill_once(mode: str, port: int) -> float:
    """One fresh server, one kill: each kill is the first death of its worker (the backoff doubles
    with each death that follows a short life, which would lengthen later kills)."""
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PDSERVE_WORKER_START=mode)
    serve = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(lambda: _get(f"{base}/health") is not None and (_worker(base) or {}).get("state") == "live")
        _complete(base)
        epoch = _worker(base)["epoch"]
        os.kill(_pid(serve.pid), signal.SIGKILL)
        t0 = time.monotonic()
        _wait(lambda: (lambda w: w is not None and w.get("state") == "live" and w["epoch"] > epoch)(_worker(base)))
        _complete(base)
        return round(time.monotonic() - t0, 3)
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(60)


def measure(mode: str, kills: int, port: int) -> dict:
    times = [kill_once(mode, port) for _ in range(kills)]
    return {"mode": mode, "seconds": times, "median_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--modes", default="fork,exec")
    p.add_argument("--port", type=int, default=8790)
    args = p.parse_args()
    for mode in args.modes.split(","):
        print(json.dumps(measure(mode, args.kills, args.port)), flush=True)


if __name__ == "__main__":
    main()
