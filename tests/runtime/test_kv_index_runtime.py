"""The cluster K/V index in the runtime: a prompt served on one worker puts its blocks in the
router's index under that worker (from the worker's heartbeat events, not a full list), the
prefix policy then prefers that worker, and killing the worker removes them."""

from __future__ import annotations

import asyncio
import time

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from pdserve.router.messages import RoutePlan, RouteRequest
from tests.runtime.conftest import collect, config, prompt


async def until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return found


def test_served_blocks_enter_the_index_steer_the_prefix_policy_and_leave_with_the_worker():
    async def main():
        async with cluster(config(num_prefill=2, num_decode=1, policy="prefix")) as (backend, launcher):
            router = backend.router
            ids = prompt(100, 3)
            hashes = backend._block_hashes(ids)  # the router's keys of the prompt's 6 full blocks
            assert len(hashes) == 6 and all(not router.kv_holders(h) for h in hashes)
            tokens, event = await collect(backend, "first", ids, SamplingParams(max_tokens=4, ignore_eos=True))
            assert isinstance(event, FinishEvent) and len(tokens) == 4

            def prefill_holder():
                owners = [{loc.worker_id for loc in router.kv_holders(h) if loc.worker_id.startswith("prefill")} for h in hashes]
                common = set.intersection(*owners)
                return next(iter(common)) if len(common) == 1 else None

            holder = await until(prefill_holder)
            assert all(loc.epoch == 1 for h in hashes for loc in router.kv_holders(h))
            stats = router.kv_index_stats()
            assert stats.entries >= 6 and stats.num_resyncs_applied >= 3  # each worker's first heartbeat
            text = backend.metrics_text().decode()
            assert f"pdserve_kv_index_entries {float(stats.entries)}\n" in text
            assert "pdserve_kv_index_memory_bytes" in text and "pdserve_kv_index_evictions_total 0.0" in text

            follow_up = ids[:96] + prompt(40, 4)  # the same 6 leading blocks, another tail
            plan = router.route(RouteRequest("probe", len(follow_up), 4, backend._block_hashes(follow_up)))
            assert isinstance(plan, RoutePlan) and (plan.prefill_id, plan.prefill_hit_blocks) == (holder, 6)
            router.complete("probe")

            launcher.kill(holder)
            await until(lambda: all(holder not in {loc.worker_id for loc in router.kv_holders(h)} for h in hashes))
            plan = router.route(RouteRequest("probe2", len(follow_up), 4, backend._block_hashes(follow_up)))
            assert isinstance(plan, RoutePlan) and plan.prefill_id != holder and plan.prefill_hit_blocks == 0
            router.complete("probe2")

    asyncio.run(main())
