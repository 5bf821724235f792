#!/usr/bin/env python3
"""KV-Runahead figure: TTFT of 2k-token prompts, a 2-worker chain against one prefill worker.

Usage: scripts/runahead_ttft.py OUT_DIR [--rounds 5] [--tokens 2048] [--model small]

Starts two servers side by side, the same shape (2 prefill + 1 decode workers, 1 pinned thread
each, fp32, chunk budget 1024, every request handed off):
    single:   pdserve serve --model small --dtype float32 --prefill 2 --decode 1 --threads-per-worker 1
              --max-num-batched-tokens 1024 --pd-decision always --kv-cache-mb 256 --lease-s 3600
    runahead: the same + --prefill-runahead 2 --runahead-min-tokens 1024
then, round by round, sends one fresh 2048-token prompt to each (the order alternates; one
request at a time, so the idle server only polls), greedy, 8 output tokens. TTFT is the
router's own clock (the trace line's ttft_s: arrival to first token sent). A warm-up request per
server is left out. Writes OUT_DIR/summary.json: per-arm TTFTs, medians, the ratio, whether every
round's tokens matched, the load average before and after, and the CPU kind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BASE = ["--dtype", "float32", "--prefill", "2", "--decode", "1", "--threads-per-worker", "1",
        "--max-num-batched-tokens", "1024", "--pd-decision", "always", "--kv-cache-mb", "256", "--lease-s", "3600"]
ARMS = {"single": [], "runahead": ["--prefill-runahead", "2", "--runahead-min-tokens", "1024"]}


def start(name: str, port: int, model: str, out: Path) -> subprocess.Popen:
    trace = out / name
    trace.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, *BASE, *ARMS[name], "--port", str(port),
           "--trace-dir", str(trace)]
    (out / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
    return subprocess.Popen(cmd, stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)


def wait_up(port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server on {port} did not come up")


def complete(port: int, model: str, ids: list[int]) -> tuple[str, list[int]]:
    body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out["id"], out["choices"][0]["token_ids"]


def ttfts(trace: Path) -> dict[str, dict]:
    lines = [json.loads(x) for x in (trace / "requests.jsonl").read_text().splitlines() if x.strip()]
    return {x["request_id"]: x for x in lines}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--model", default="small")
    ap.add_argument("--port", type=int, default=8031)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ports = {"single": args.port, "runahead": args.port + 1}
    load_before = os.getloadavg()
    procs = {name: start(name, ports[name], args.model, out) for name in ARMS}
    try:
        for name in ARMS:
            wait_up(ports[name])
        rng = random.Random(11)
        prompts = [[rng.randrange(3, 256) for _ in range(args.tokens)] for _ in range(args.rounds + 1)]
        runs: dict[str, list[tuple[str, list[int]]]] = {name: [] for name in ARMS}
        for n, ids in enumerate(prompts):
            order = list(ARMS) if n % 2 == 0 else list(reversed(ARMS))
            for name in order:
                runs[name].append(complete(ports[name], args.model, ids))
        time.sleep(1.0)  # the trace lines are written as requests finish
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=60)
    load_after = os.getloadavg()
    result = {"cpu": subprocess.run("grep -o 'avx512_bf16\\|amx_tile' /proc/cpuinfo | sort -u", shell=True,
                                    capture_output=True, text=True).stdout.split(),
              "load_before": load_before, "load_after": load_after, "tokens": args.tokens, "rounds": args.rounds,
              "commands": {name: (out / f"{name}.cmd").read_text().strip() for name in ARMS}}
    for name in ARMS:
        lines = ttfts(out / name)
        measured = runs[name][1:]  # the first request of each server is a warm-up
        result[name] = {"ttft_s": [lines[rid]["ttft_s"] for rid, _ in measured],
                        "partition": [lines[rid].get("runahead_partition") for rid, _ in measured],
                        "token_ids": [ids for _, ids in runs[name]]}
        result[name]["median_ttft_s"] = statistics.median(result[name]["ttft_s"])
    result["ratio"] = result["runahead"]["median_ttft_s"] / result["single"]["median_ttft_s"]
    result["tokens_identical"] = all(a[1] == b[1] for a, b in zip(runs["single"], runs["runahead"]))
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ratio", "tokens_identical", "load_before", "load_after")}),
          {name: result[name]["median_ttft_s"] for name in ARMS})


if __name__ == "__main__":
    main()
