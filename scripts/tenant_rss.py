"""Resident memory of every `pdserve serve` process under many random `cache_salt` values
(issue 36, part 5): starts a 1P1D tiny-model server, sends SALTS requests (each its own salt,
one short prompt, one output token, CONCURRENCY at a time) and prints each process's RSS after
a warm-up of WARMUP salts and after all of them, with the workers' tenant tables (`/workers`).

    python scripts/tenant_rss.py [SALTS] [--warmup N] [--concurrency N] [--max-tenant-roots N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def send(client: httpx.AsyncClient, salts: list[str], concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, salt: str) -> None:
        async with gate:
            body = {"model": "tiny", "prompt": [3 + (i + k) % 200 for k in range(20)], "max_tokens": 1,
                    "temperature": 0, "cache_salt": salt}
            reply = await client.post("/v1/completions", json=body)
            reply.raise_for_status()

    await asyncio.gather(*(one(i, s) for i, s in enumerate(salts)))


def snapshot(client: httpx.Client, server_pid: int) -> dict:
    workers = client.get("/workers").json()
    rows = {"server": {"pid": server_pid, "rss_kib": rss_kib(server_pid)}}
    for w in workers:
        rows[w["id"]] = {"pid": w["pid"], "rss_kib": rss_kib(w["pid"]), "tenant_roots": w["load"].get("tenant_roots")}
    return rows


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("salts", type=int, nargs="?", default=10_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tenant-roots", type=int, default=1024)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--model", "tiny", "--kv-cache-mb", "48",
                               "--port", str(port), "--max-tenant-roots", str(args.max_tenant_roots)],
                              env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=10) as sync:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if sync.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not come up")
                time.sleep(0.5)
            rng = random.Random(0)
            salts = [f"{rng.getrandbits(128):032x}" for _ in range(args.salts)]
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                await send(client, salts[: args.warmup], args.concurrency)
                time.sleep(1.0)  # a heartbeat reports the tables
                warm = snapshot(sync, server.pid)
                await send(client, salts[args.warmup :], args.concurrency)
                time.sleep(1.0)
                done = snapshot(sync, server.pid)
        report = {"salts": args.salts, "warmup": args.warmup, "max_tenant_roots": args.max_tenant_roots,
                  "after_warmup": warm, "after_all": done,
                  "growth_kib": {k: done[k]["rss_kib"] - warm[k]["rss_kib"] for k in done}}
        print(json.dumps(report, indent=2))
        return 0
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
