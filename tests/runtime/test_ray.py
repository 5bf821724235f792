"""The Ray launcher on a local single-node Ray cluster: same workers, same answers as in-process.

The test starts Ray itself (3 logical CPUs, no dashboard) so RayCluster joins it rather than owning
it, and shuts it down at the end of the module. A TP 2 prefill worker under Ray (2 CPUs in its
bundle, its follower spawned by the actor) serves the tokens of a TP 1 engine (fp32).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
import ray

from pdserve.api.backend import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from pdserve.api.server import ServeConfig, cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.ray_launch import RayCluster, group_workers
from pdserve.workers.process.tp_rank import TpShape
from tests.runtime.conftest import WORKER_THREADS, wait_baseline
from tests.runtime.test_tp_served import followers

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
ENGINE = EngineConfig(model="tiny", kv_cache_bytes=32 << 20)
REQUESTS_TIMEOUT_S = 120.0  # a lost handoff must fail the test, not hang it (loose: a loaded machine is slow)
RAY_SETTLE_S = 60.0  # Ray frees actors and notices deaths asynchronously
RAY_CPUS = 3  # logical: a TP 2 worker's bundle takes 2, its decode partner 1


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=True)
    try:
        yield ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def expected() -> list[tuple[int, ...]]:
    engine = Engine(EngineConfig(model="tiny", dtype=ENGINE.dtype, num_threads=WORKER_THREADS))
    return [out.output_ids for out in engine.generate(prompts(), PARAMS)]


async def collect(backend, rid: str, prompt: list[int]) -> tuple[int, ...]:
    tokens: list[int] = []
    finish = None
    async for event in backend.submit(GenerationRequest(rid, tuple(prompt), PARAMS)):
        if isinstance(event, ErrorEvent):
            raise AssertionError(f"{rid}: {event.code}: {event.message}")
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        elif isinstance(event, FinishEvent):
            finish = event
    assert finish is not None and finish.finish_reason == "length"
    assert finish.completion_tokens == len(tokens) == PARAMS.max_tokens
    return tuple(tokens)


async def run_cluster(config: ServeConfig, node_id: str, then=None) -> list[tuple[int, ...]]:
    async with cluster(config) as (backend, launcher):
        assert isinstance(launcher.impl, RayCluster)
        views = {v.id: v for v in backend.workers()}
        assert set(views) == {cfg.worker_id for cfg in launcher.impl.configs.values()}
        for wid, view in views.items():
            assert view.pid == launcher.pid(wid) != os.getpid()
            assert view.host == node_id
        requests = asyncio.gather(*(collect(backend, f"r{i}", p) for i, p in enumerate(prompts())))
        outputs = await asyncio.wait_for(requests, REQUESTS_TIMEOUT_S)
        assert not backend.live
        backend.router.assert_no_leaks()
        assert launcher.dead() == []
        if then is not None:
            await then(backend, launcher)
    assert_ray_released()
    return list(outputs)


def assert_ray_released(timeout_s: float = RAY_SETTLE_S) -> None:
    """Every actor and placement group is gone (Ray frees them asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources()
        if free.get("CPU") == RAY_CPUS and not any(k.startswith("bundle_group") for k in free):
            return
        assert time.monotonic() < deadline, f"Ray resources still held: {free}"
        time.sleep(0.1)


def test_disaggregated_on_ray_matches_in_process(ray_local, expected):
    config = ServeConfig(ray=True, mode="disaggregated", num_prefill=1, num_decode=1, engine=ENGINE,
                         transport="tcp", ray_pack_pairs=True, startup_timeout_s=60.0, pd_decision="always")
    assert asyncio.run(run_cluster(config, ray_local)) == expected


def test_tp2_prefill_worker_on_ray_serves_the_tokens_of_tp1(ray_local):
    """`--ray --prefill-tp 2` (transport auto): the prefill actor reserves 2 CPUs and runs one
    follower rank; with a TP 1 decode actor it gives a TP 1 engine's greedy tokens (fp32); pools
    end at baseline and every actor and bundle is released."""
    fp32 = EngineConfig(model="tiny", dtype="float32", kv_cache_bytes=32 << 20)
    reference = Engine(EngineConfig(model="tiny", dtype="float32", num_threads=WORKER_THREADS))
    want = [out.output_ids for out in reference.generate(prompts(), PARAMS)]

    async def check_ranks(backend, launcher):
        assert launcher.impl.cpus == {"prefill-0": 2.0, "decode-0": 1.0}
        assert [(c.engine.tp, c.engine.num_threads, c.engine.tp_cores, c.cpu_affinity)
                for c in launcher.impl.configs.values()] == [(2, 1, (), ()), (1, 1, (), ())]  # unpinned
        assert {w.id: w.tp for w in backend.workers()} == {"prefill-0": 2, "decode-0": 1}
        assert len(followers(launcher.pid("prefill-0"))) == 1 and followers(launcher.pid("decode-0")) == []
        await wait_baseline(backend)

    config = ServeConfig(ray=True, mode="disaggregated", engine=fp32, tp=TpShape(prefill=2, decode=1), transport="auto",
                         ray_pack_pairs=True, startup_timeout_s=90.0, pd_decision="always")
    assert asyncio.run(run_cluster(config, ray_local, then=check_ranks)) == want


def test_colocated_on_ray_matches_in_process_and_survives_a_killed_actor(ray_local, expected):
    """A killed actor is retired, the survivor serves, and a new actor in the dead one's bundle
    registers under epoch 2 and serves too (supervision through Ray)."""
    async def kill_one(backend, launcher):
        launcher.kill("colocated-1")
        deadline = time.monotonic() + RAY_SETTLE_S
        while any(v.id == "colocated-1" and v.epoch == 1 for v in backend.workers()):  # dead() reported it
            assert time.monotonic() < deadline, "killed actor still registered"
            await asyncio.sleep(0.1)
        assert await asyncio.wait_for(collect(backend, "after-kill", prompts()[0]), REQUESTS_TIMEOUT_S) == expected[0]
        deadline = time.monotonic() + REQUESTS_TIMEOUT_S
        while not any(v.id == "colocated-1" and v.epoch == 2 and v.load for v in backend.workers()):
            assert time.monotonic() < deadline, "killed actor not replaced"
            await asyncio.sleep(0.2)
        assert launcher.num_restarts == 1
        assert await asyncio.wait_for(collect(backend, "after-restart", prompts()[0]), REQUESTS_TIMEOUT_S) == expected[0]

    config = ServeConfig(ray=True, mode="colocated", replicas=2, engine=ENGINE, startup_timeout_s=60.0)
    assert asyncio.run(run_cluster(config, ray_local, then=kill_one)) == expected


def test_pairs_share_a_strict_pack_group():
    ids = ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    assert group_workers(ids, pack_pairs=False) == [("PACK", ids)]
    assert group_workers(ids, pack_pairs=True) == [
        ("STRICT_PACK", ["prefill-0", "decode-0"]), ("STRICT_PACK", ["prefill-1", "decode-1"]), ("PACK", ["decode-2"]),
    ]
    assert group_workers(["colocated-0", "colocated-1"], pack_pairs=True) == [("PACK", ["colocated-0", "colocated-1"])]

