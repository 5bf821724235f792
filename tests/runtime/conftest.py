"""Process-level runtime fixtures: real worker processes, the router backend, optionally HTTP."""

from __future__ import annotations

import asyncio
import random
import time

from pdserve.api.backend import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from pdserve.api.server import ServeConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.supervisor import RestartPolicy

TINY = EngineConfig(model="tiny", kv_cache_bytes=48 << 20)
# A local engine the workers' tokens are compared with computes on the workers' thread count
# (ServeConfig.threads_per_worker): a BLAS may sum in another order on another thread count.
WORKER_THREADS = 1


def config(**kw) -> ServeConfig:
    """A tiny-model deployment; dead workers stay dead unless a test asks for restarts
    (tests/runtime/test_supervision.py), so fault tests see the cluster they shrank. Every
    request takes the handoff (`pd_decision="always"`) unless a test asks for the per-request
    decision (tests/runtime/test_pd_decision.py). A colocated deployment prices with the
    placeholders unless a test gives a profile (`pdserve serve` fits one at start: each test
    would pay for it, and the fetch tests pin their decisions' inputs)."""
    if kw.get("mode") == "colocated":
        kw.setdefault("pd_profile", "none")
    kw.setdefault("engine", TINY)
    kw.setdefault("pd_decision", "always")
    kw.setdefault("restart", RestartPolicy(enabled=False))
    return ServeConfig(**kw)


def prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 256) for _ in range(n))


async def collect(backend, rid: str, ids: tuple[int, ...], params: SamplingParams) -> tuple[list[int], object]:
    """Run one request to its terminal event; returns (token ids, terminal event)."""
    tokens: list[int] = []
    async for event in backend.submit(GenerationRequest(rid, ids, params)):
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        elif isinstance(event, (FinishEvent, ErrorEvent)):
            return tokens, event
    return tokens, None


async def wait_baseline(backend, timeout_s: float = 60.0) -> list:
    """Wait until every worker reports an idle pool: nothing running, nothing reserved, all blocks
    free, and no transfer record left in its handoff endpoints (finished ones are released)."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = [w for w in backend.workers() if w.state != "failed"]  # a FAILED worker has no pool any more
        idle = [w.load and w.load["num_running"] == 0 and w.load["reserved_blocks"] == 0
                and w.load["free_blocks"] == w.load["num_blocks"] and w.load["integrity_ok"]
                and w.load["handoff_records"] == 0 for w in views]
        if views and all(idle) and not backend.live:
            return views
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not back at baseline: {[(w.id, w.load) for w in views]}, live={list(backend.live)}")
        await asyncio.sleep(0.1)
