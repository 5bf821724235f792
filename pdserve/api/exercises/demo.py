"""The demo's workload, HTTP driver and comparison (see `pdserve demo`).

Contract: `run_demo(config, spec)` serves `config` (disaggregated) on a free local port, sends
`spec.num_requests` seeded requests concurrently with streaming, then serves the colocated
baseline on the same engine settings and sends the same requests; it returns the summary dict
(`completed`, `failed`, `exact_match`, `ttft_ms`, `tpot_ms`, `kv_bytes`, `exposed_transfer_ms`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, replace

import httpx
import numpy as np

from pdserve.api.server import ServeConfig, cluster
from pdserve.bench.http.sse import sse_lines
from pdserve.ports import free_local_port


@dataclass(frozen=True)
class DemoSpec:
    num_requests: int = 16
    seed: int = 0
    min_prompt: int = 8
    max_prompt: int = 300
    min_output: int = 8
    max_output: int = 48


@dataclass
class Outcome:
    ok: bool
    token_ids: list[int]
    ttft_s: float | None
    tpot_s: float | None
    error: str | None = None


def workload(spec: DemoSpec, vocab: int) -> list[dict]:
    rng = random.Random(spec.seed)
    bodies = []
    for i in range(spec.num_requests):
        n = rng.randint(spec.min_prompt, spec.max_prompt)
        body = {"prompt": [rng.randrange(3, min(vocab, 256)) for _ in range(n)],
                "max_tokens": rng.randint(spec.min_output, spec.max_output), "ignore_eos": True,
                "stream": True, "return_token_ids": True, "seed": 1000 + i}
        body["temperature"] = 0.0 if i % 2 == 0 else 0.8
        bodies.append(body)
    return bodies


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    t0, times, ids = time.monotonic(), [], []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return Outcome(False, [], None, None, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in sse_lines(resp.aiter_bytes()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(False, ids, None, None, chunk["error"].get("message"))
                for choice in chunk.get("choices", []):
                    new = choice.get("token_ids") or []
                    if new:
                        times.append(time.monotonic())
                        ids.extend(new)
    except httpx.HTTPError as exc:
        return Outcome(False, ids, None, None, repr(exc))
    ttft = times[0] - t0 if times else None
    tpot = (times[-1] - times[0]) / (len(ids) - 1) if len(ids) > 1 else None
    return Outcome(len(ids) == body["max_tokens"], ids, ttft, tpot, None if len(ids) == body["max_tokens"] else "short")


async def _drive(config: ServeConfig, bodies: list[dict], model: str) -> tuple[list[Outcome], dict]:
    import uvicorn

    from pdserve.api.app import create_app

    port = free_local_port()
    async with cluster(replace(config, port=port)) as (backend, _):
        server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with httpx.AsyncClient(timeout=300.0) as client:
            outcomes = await asyncio.gather(*(_one(client, url, {**b, "model": model}) for b in bodies))
            metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        server.should_exit = True
        await task
        return list(outcomes), {"kv_bytes": _metric(metrics, "pdserve_kv_transfer_bytes_total"),
                                "exposed_s": backend.trace.values("kv_exposed_s")}


async def run_demo(config: ServeConfig, spec: DemoSpec) -> dict:
    from pdserve.api.server import model_name
    from pdserve.model.config import load_config
    from pdserve.model.default import resolve_model

    vocab = load_config(resolve_model(config.engine.model)).vocab_size
    bodies = workload(spec, vocab)
    model = model_name(config)
    disagg, info = await _drive(config, bodies, model)
    baseline = replace(config, mode="colocated", replicas=1)
    coloc, _ = await _drive(baseline, bodies, model)
    exact = [a.ok and b.ok and a.token_ids == b.token_ids for a, b in zip(disagg, coloc)]
    ok = [o for o in disagg if o.ok]
    return {
        "completed": len(ok), "failed": len(disagg) - len(ok), "exact_match": all(exact) and bool(exact),
        "num_exact": sum(exact), "ttft_ms": _pcts([o.ttft_s for o in ok]), "tpot_ms": _pcts([o.tpot_s for o in ok]),
        "kv_bytes": int(info["kv_bytes"]), "exposed_transfer_ms": _pcts(info["exposed_s"]),
        "errors": [o.error for o in disagg if not o.ok][:5],
    }


def _pcts(values_s: list[float | None]) -> dict:
    vals = [v * 1e3 for v in values_s if v is not None]
    if not vals:
        return {"p50": 0.0, "p90": 0.0}
    return {"p50": float(np.percentile(vals, 50)), "p90": float(np.percentile(vals, 90))}


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
