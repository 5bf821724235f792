"""Cross-worker prefix fetch through the served runtime (tiny model, 2-replica colocated,
round robin, so the second turn lands on the worker that has not seen the conversation): with
K/V sharing the second worker fetches the history from the first (remote hit tokens > 0), with
`kv_sharing=False` it recomputes; the tokens are identical either way; a holder killed while
the fetch would run falls back to recompute; pools, pins and router holds return after each."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.kv_events import KvTier
from pdserve.engine.sequence import SamplingParams
from pdserve.router.pricing.cost import CostModel
from tests.runtime.conftest import TINY, WORKER_THREADS, collect, config, prompt, wait_baseline
from tests.runtime.test_kv_index_runtime import until

HISTORY = prompt(96, 11)  # six full blocks
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
BPB_TINY = 8 * 2 * 2 * 64 * 2 * 16  # K/V bytes per block of the tiny model: 8 layers, K and V, 2 heads, dim 64, bf16


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def _two_turns(backend, tenant2: str = "default"):
    """Turn 1 on w0, then (its blocks in the index) turn 2 = history + answer + more on w1."""
    first, event = await collect(backend, "t1", HISTORY, PARAMS)
    assert isinstance(event, FinishEvent)
    keys = backend._block_hashes(HISTORY)
    await until(lambda: all(backend.router.kv_holders(k) for k in keys))
    turn2 = HISTORY + tuple(first) + prompt(20, 12)
    params = SamplingParams(max_tokens=5, ignore_eos=True, tenant=tenant2)
    second, event = await collect(backend, "t2", turn2, params)
    assert isinstance(event, FinishEvent)
    await wait_baseline(backend)
    backend.router.assert_no_leaks()
    await until(lambda: backend.hits.num_pending == 0)  # the hit counters settle at the workers' next reports
    lines = {line["request_id"]: line for line in backend.trace.recent}
    return first, second, lines, backend.metrics_text().decode()


def test_second_turn_fetches_history_from_the_other_replica_and_tokens_match():
    async def main(sharing: bool):
        cfg = config(mode="colocated", replicas=2, policy="round_robin", kv_sharing=sharing)
        async with cluster(cfg) as (backend, _):
            return await _two_turns(backend)

    first, second, lines, text = asyncio.run(main(True))
    first_off, second_off, lines_off, text_off = asyncio.run(main(False))
    assert (first, second) == (first_off, second_off)  # the fetched K/V decodes exactly as recomputed
    t2 = lines["t2"]
    assert (t2["fetch"], t2["fetch_remote_blocks"], t2["fetch_landed_blocks"]) == ("fetch", 6, 6)
    assert t2["cached_tokens"] >= 96  # the fetched history is served from the prefix cache
    assert _metric(text, 'pdserve_prefix_hit_tokens_total{where="remote_device"}') == 96
    assert _metric(text, 'pdserve_prefix_hit_tokens_total{where="remote_host"}') == 0
    assert _metric(text, "pdserve_kv_fetch_bytes_total") > 0
    assert _metric(text, "pdserve_kv_fetch_seconds_count") == 1
    assert 'pdserve_kv_tier_blocks{state="cached",tier="device",worker=' in text
    assert "fetch" not in lines_off["t2"] and lines_off["t2"].get("cached_tokens", 0) == 0
    assert _metric(text_off, 'pdserve_prefix_hit_tokens_total{where="remote_device"}') == 0


def test_another_tenant_never_fetches():
    async def main():
        cfg = config(mode="colocated", replicas=2, policy="round_robin")
        async with cluster(cfg) as (backend, _):
            return await _two_turns(backend, tenant2="bob")

    _, _, lines, text = asyncio.run(main())
    assert lines["t2"]["fetch"] == "local" and lines["t2"].get("cached_tokens", 0) == 0  # nobody holds bob's prefix
    assert _metric(text, "pdserve_kv_fetch_bytes_total") == 0


def test_holder_killed_before_the_fetch_recomputes_with_the_same_tokens():
    async def main():
        cfg = config(mode="colocated", replicas=3, policy="round_robin")
        async with cluster(cfg) as (backend, launcher):
            first, event = await collect(backend, "t1", HISTORY, PARAMS)  # on w0
            keys = backend._block_hashes(HISTORY)
            await until(lambda: all(backend.router.kv_holders(k) for k in keys))
            holder = backend.router.kv_holders(keys[0])[0].worker_id
            # the next route goes to another worker; the holder dies as the fetch is planned
            runner = backend.fetches
            original = runner._plan

            def plan_then_kill(live, job, *answers):  # the destination's reservation, the holder's pins
                launcher.kill(holder)
                return original(live, job, *answers)

            runner._plan = plan_then_kill
            turn2 = HISTORY + tuple(first) + prompt(20, 12)
            second, event = await collect(backend, "t2", turn2, PARAMS)
            assert isinstance(event, FinishEvent)
            lines = {line["request_id"]: line for line in backend.trace.recent}
            await until(lambda: holder not in backend.registered)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            return first, second, lines["t2"]

    first, second, t2 = asyncio.run(main())
    assert t2["fetch"] == "fetch" and t2["fetch_landed_blocks"] == 0 and t2["fetch_failure"] in ("holder_lost", "source_failed", "transport_failure", "aborted")
    # the recompute's tokens: a single engine computing both turns from scratch (greedy)
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    assert first == list(alone.generate([list(HISTORY)], PARAMS)[0].output_ids)
    assert second == list(alone.generate([list(HISTORY) + first + list(prompt(20, 12))], PARAMS)[0].output_ids)


def test_decode_history_stays_cached_and_moves_back_to_the_prefill_worker():
    """1P1D (PD-Caching levels 2 and 3): the handed-off prompt and the answer decoded on D stay in
    D's prefix cache; the next turn's prefill worker holds only the prompt, so it fetches the
    answer's blocks from D instead of recomputing them; tokens equal the no-sharing run."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main(sharing: bool):
        async with cluster(config(kv_sharing=sharing)) as (backend, _):
            first, _ = await collect(backend, "t1", HISTORY, params)
            answer_keys = backend._block_hashes(HISTORY + tuple(first[:-1]))  # 135 computed tokens: 8 blocks
            held = lambda k: {loc.worker_id for loc in backend.router.kv_holders(k)}  # noqa: E731
            # both workers' reports in the index: D's whole history, and P's prompt (its own report,
            # which may reach the router after D's: a slow machine otherwise plans t2 without it)
            await until(lambda: all(held(k) for k in answer_keys) and all("prefill-0" in held(k) for k in answer_keys[:6]))
            holders = held(answer_keys[-1])
            second, _ = await collect(backend, "t2", HISTORY + tuple(first) + prompt(20, 12), PARAMS)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            lines = {line["request_id"]: line for line in backend.trace.recent}
            return first, second, holders, lines["t2"]

    first, second, holders, t2 = asyncio.run(main(True))
    assert holders == {"decode-0"}  # level 2: the decoded history is cached where it was decoded
    assert (t2["fetch"], t2["fetch_holder"], t2["fetch_local_blocks"], t2["fetch_landed_blocks"]) == \
        ("fetch", "decode-0", 6, 2)  # level 3: only the answer's two blocks move back to P
    assert t2["cached_tokens"] == 8 * 16
    first_off, second_off, _, t2_off = asyncio.run(main(False))
    assert (first, second) == (first_off, second_off) and t2_off["cached_tokens"] == 6 * 16


def test_host_tier_serves_an_evicted_history_and_shows_in_workers_and_metrics(tmp_path):
    """One colocated replica with a 24-block device pool and a host tier: a conversation's history
    evicted by other prompts comes back from the host tier (tokens as without the tier); the
    prefix policy saw it in the host tier (the index's DEMOTED entries) and priced its promotion
    at the worker's measured copy rate (the trace line's route terms; measured rates apply to a
    fitted cost model, so the router gets a profile file)."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill_coef": [0.005, 0.001, 0.0], "decode_coef": [0.01, 0.001, 0.0]}))
    engine = replace(TINY, num_blocks=24)
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=3)

    async def main(host_blocks: int):
        cfg = config(mode="colocated", replicas=1, policy="prefix", pd_profile=str(profile),
                     engine=replace(engine, host_kv_bytes=host_blocks * BPB_TINY))
        async with cluster(cfg) as (backend, _):
            first, _ = await collect(backend, "t1", HISTORY, params)
            for i in range(3):  # 3 x 150 tokens through a 24-block pool: the history is evicted
                await collect(backend, f"other{i}", prompt(150, 40 + i), params)
            keys = backend._block_hashes(HISTORY)
            await until(lambda: all(loc.tier == KvTier.HOST for k in keys for loc in backend.router.kv_holders(k))
                        and all(backend.router.kv_holders(k) for k in keys) or not host_blocks, timeout_s=10)
            second, _ = await collect(backend, "t2", HISTORY + tuple(first) + prompt(20, 12), params)
            await wait_baseline(backend)
            await until(lambda: backend.workers()[0].load.get("kv_tiers", {}).get("host", {}).get("hits", 0) > 0
                        or not host_blocks, timeout_s=10)
            await until(lambda: backend.hits.num_pending == 0)  # the hit counters settle at the next report
            lines = {line["request_id"]: line for line in backend.trace.recent}
            return second, lines["t2"], backend.workers()[0].load, backend.metrics_text().decode()

    second, t2, load, text = asyncio.run(main(64))
    assert (t2["route_hit_blocks"], t2["route_host_blocks"], t2["route_fetch_blocks"]) == (6, 6, 0)
    rate = t2["route_host_bytes_per_s"]  # measured (calibration copies, promotions), not the 10 GB/s placeholder
    assert rate != CostModel().host_copy_bytes_per_s and t2["route_host_s"] == round(6 * BPB_TINY / rate, 6)
    assert t2["cached_tokens"] == 96 and load["kv_tiers"]["host"]["hits"] == 6 and load["kv_tiers"]["host"]["capacity"] == 64
    assert _metric(text, 'pdserve_prefix_hit_tokens_total{where="local_host"}') == 96
    assert 'pdserve_kv_tier_blocks{state="used",tier="host",worker="colocated-0"}' in text
    second_off, t2_off, _, _ = asyncio.run(main(0))
    assert t2_off.get("cached_tokens", 0) == 0 and second_off == second
