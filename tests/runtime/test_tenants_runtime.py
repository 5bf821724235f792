"""Tenant isolation across the handoff (1P1D, tiny model): two tenants sending one prompt share
no cached K/V on either worker, while one tenant's repeat hits on the prefill worker and moves
only what the decode worker lacks; tokens are the same for everyone."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from pdserve.api.backend import FinishEvent, GenerationRequest, TokenEvent
from pdserve.api.server import cluster
from pdserve.api.tenants import TenantResolver
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import TINY, collect, config, prompt, wait_baseline

PROMPT = prompt(64, 77)  # four full blocks


async def run(backend, rid: str, tenant: str) -> list[int]:
    params = SamplingParams(max_tokens=6, ignore_eos=True, tenant=tenant)
    tokens = []
    async for event in backend.submit(GenerationRequest(rid, PROMPT, params, tenant=tenant)):
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        assert not isinstance(event, FinishEvent) or event.finish_reason == "length"
    return tokens


async def _scenario():
    async with cluster(config()) as (backend, _):
        outputs = [await run(backend, f"r{i}", tenant) for i, tenant in enumerate(["alice", "alice", "bob", "bob"])]
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        lines = {line["request_id"]: line for line in backend.trace.recent}
        return outputs, [lines[f"r{i}"] for i in range(4)]


def test_two_tenants_share_nothing_and_one_tenant_reuses_its_own():
    outputs, lines = asyncio.run(_scenario())
    assert all(out == outputs[0] for out in outputs)
    assert [line.get("cached_tokens", 0) for line in lines] == [0, 48, 0, 48]  # prefill-side hits, own tenant only
    moved = [line["kv_bytes"] for line in lines]
    assert moved[1] < moved[0] and moved[3] < moved[2] and moved[0] == moved[2]  # bob's first moves it all again


async def _many_salts(num_salts: int, bound: int) -> list[dict]:
    """`num_salts` requests, each with its own random `cache_salt` (as the API resolves it), 16 at
    a time; then the workers' loads once their next heartbeat counted every request."""
    resolver, rng = TenantResolver(), random.Random(5)
    salts = [f"{rng.getrandbits(64):x}" for _ in range(num_salts)]
    async with cluster(config(engine=replace(TINY, max_tenant_roots=bound))) as (backend, _):
        params = lambda tenant: SamplingParams(max_tokens=1, ignore_eos=True, tenant=tenant)  # noqa: E731
        for start in range(0, num_salts, 16):
            batch = [resolver.tenant(None, salt) for salt in salts[start:start + 16]]
            events = await asyncio.gather(*(collect(backend, f"s{start + i}", prompt(20, i), params(t))
                                            for i, t in enumerate(batch)))
            assert all(isinstance(event, FinishEvent) for _, event in events)
        views = await wait_baseline(backend)
        backend.router.assert_no_leaks()
        return [dict(w.load, id=w.id) for w in views]


def test_many_cache_salts_leave_each_worker_s_tenant_table_at_its_bound():
    """96 distinct salts against a bound of 16: every worker keeps exactly 16 tenant roots (the
    prefill worker hashed every prompt under its tenant; the decode worker imported each)."""
    loads = asyncio.run(_many_salts(96, 16))
    assert sorted(load["id"] for load in loads) == ["decode-0", "prefill-0"]
    assert [load["tenant_roots"] for load in loads] == [16, 16]
