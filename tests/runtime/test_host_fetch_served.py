"""A prefix fetch served from the holder's host tier, read in place, through the served runtime
(tiny model, 2 colocated replicas, round robin, 24-block device pools with host tiers): the
first worker's history is evicted into its host tier by other prompts, the second turn lands on
the other worker, whose fetch pins the history's host slots at the holder (FetchPin), reads them
under a capability that names those (segment, slot) pairs and decodes the same tokens as an
engine that recomputes; the holder promoted nothing, its /workers row and the metrics count the
in-place reads; pools, pins and router holds return to baseline."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from pdserve.api.server import cluster
from pdserve.engine.engine import Engine
from pdserve.engine.kv.kv_events import KvTier
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import TINY, collect, config, prompt, wait_baseline
from tests.runtime.test_kv_fetch_runtime import BPB_TINY, HISTORY, _metric
from tests.runtime.test_kv_index_runtime import until

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, seed=3)


def test_second_turn_reads_the_holders_host_tier_in_place():
    engine = replace(TINY, num_blocks=24, host_kv_bytes=64 * BPB_TINY)

    async def main():
        cfg = config(mode="colocated", replicas=2, policy="round_robin", engine=engine)
        async with cluster(cfg) as (backend, _):
            first, _ = await collect(backend, "t1", HISTORY, PARAMS)  # on one worker, the holder
            for i in range(6):  # 3 x 150 tokens on each worker: the holder demotes the history
                await collect(backend, f"other{i}", prompt(150, 40 + i), PARAMS)
            keys = backend._block_hashes(HISTORY)
            await until(lambda: all(backend.router.kv_holders(k) and all(loc.tier == KvTier.HOST
                                                                       for loc in backend.router.kv_holders(k))
                                    for k in keys), timeout_s=10)
            holder = backend.router.kv_holders(keys[0])[0].worker_id

            def holder_load() -> dict:  # its /workers row (rows follow registration order)
                return next(w.load for w in backend.workers() if w.id == holder)

            turn2 = HISTORY + tuple(first) + prompt(20, 12)
            second, _ = await collect(backend, "t2", turn2, PARAMS)  # on the other worker
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            await until(lambda: holder_load()["kv_tiers"]["host"]["inplace_reads"] > 0, timeout_s=10)
            await until(lambda: backend.hits.num_pending == 0, timeout_s=10)  # hit counters settle at the reports
            lines = {line["request_id"]: line for line in backend.trace.recent}
            return first, second, lines["t2"], holder_load(), backend.metrics_text().decode(), turn2

    first, second, t2, load, text, turn2 = asyncio.run(main())
    assert (t2["fetch"], t2["fetch_remote_blocks"], t2["fetch_landed_blocks"]) == ("fetch", 6, 6)
    assert load["kv_tiers"]["host"]["inplace_reads"] == 6 and load["kv_tiers"]["host"]["hits"] == 0  # read, not promoted
    assert load["kv_tiers"]["host"]["pinned"] == 0
    assert _metric(text, 'pdserve_prefix_hit_tokens_total{where="remote_host"}') == 96
    assert _metric(text, 'pdserve_prefix_hit_tokens_total{where="remote_device"}') == 0
    reference = Engine(replace(TINY, num_threads=1))
    assert list(reference.generate([list(HISTORY)], PARAMS)[0].output_ids) == first
    assert list(reference.generate([list(turn2)], PARAMS)[0].output_ids) == second
