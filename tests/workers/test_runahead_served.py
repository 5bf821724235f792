"""KV-Runahead through `pdserve serve`'s stack: a 2-worker chain gives the tokens one prefill
worker gives, and a chain whose inner worker dies falls back to a single-worker prefill with
the same tokens and every pool back at baseline."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.supervisor import RestartPolicy
from tests.runtime.conftest import collect, config, prompt, wait_baseline

ENGINE = EngineConfig(model="tiny", dtype="float32", kv_cache_bytes=48 << 20, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
LENGTHS = (200, 320, 131)  # 4, 5 and 3 chunks of 64; all at or above the threshold
FAST = RestartPolicy(first_delay_s=0.2, max_delay_s=1.0)


def _counter(backend, outcome: str) -> float:
    return backend.metrics.registry.get_sample_value("pdserve_runahead_prefills_total", {"outcome": outcome}) or 0.0


async def _serve_all(backend, tag: str) -> list[list[int]]:
    out = []
    for n, length in enumerate(LENGTHS):
        ids, event = await collect(backend, f"{tag}-{n}", prompt(length, n), PARAMS)
        assert isinstance(event, FinishEvent), event
        out.append(ids)
    return out


def test_a_two_worker_chain_gives_the_single_worker_tokens(tmp_path):
    # one prefill worker's tokens: a single engine of the workers' configuration (threads included)
    single = [_reference(prompt(length, n)) for n, length in enumerate(LENGTHS)]

    async def main():
        async with cluster(config(engine=ENGINE, num_prefill=2, prefill_runahead=2, runahead_min_tokens=128,
                                  trace_dir=str(tmp_path))) as (backend, _):
            chained = await _serve_all(backend, "k2")
            short, event = await collect(backend, "short", prompt(100, 9), PARAMS)  # under the threshold
            assert isinstance(event, FinishEvent) and len(short) == 8
            assert _counter(backend, "chained") == len(LENGTHS) and _counter(backend, "fallback") == 0
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
        assert chained == single and all(len(t) == 8 for t in chained)
        lines = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
        by_id = {x["request_id"]: x for x in lines}
        assert [by_id[f"k2-{n}"]["runahead_partition"] for n in range(3)] == [[64, 136], [64, 256], [64, 67]]
        assert all(sorted(by_id[f"k2-{n}"]["runahead_workers"]) == ["prefill-0", "prefill-1"] for n in range(3))
        assert "runahead_partition" not in by_id["short"]

    asyncio.run(main())


def _reference(ids: tuple[int, ...]) -> list[int]:
    engine = Engine(EngineConfig(**{**ENGINE.__dict__, "num_threads": 1}))
    return list(engine.generate([list(ids)], PARAMS)[0].output_ids)


def test_a_broken_chain_falls_back_to_one_worker_without_leaks(tmp_path):
    """The inner stage's worker is stopped as the chain starts, then killed: the last stage
    waits on a link that never comes; the router aborts the chain and one worker prefills."""
    ids = prompt(1000, 7)
    want = _reference(ids)
    # a cost model whose attention term gives stage 0 most of the chunks (896 of 1000 tokens), so
    # it is still computing when it is stopped
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill_coef": [0.005, 1e-4, 2e-6], "decode_coef": [0.01, 2e-4, 0.0]}))

    async def main():
        cfg = config(engine=ENGINE, num_prefill=2, prefill_runahead=2, runahead_min_tokens=128, restart=FAST,
                     pd_profile=str(profile))
        async with cluster(cfg) as (backend, launcher):
            for attempt in range(5):
                task = asyncio.create_task(collect(backend, f"broken-{attempt}", ids, PARAMS))
                victim = await _stop_inner_stage(backend, launcher, f"broken-{attempt}")
                live = backend.live.get(f"broken-{attempt}")
                caught = live is not None and live.first_token_s is None
                os.kill(launcher.pid(victim), signal.SIGKILL)
                tokens, event = await task
                assert isinstance(event, FinishEvent) and tokens == want
                if caught:
                    break
                await _wait_live(backend, victim)
            assert caught, "the chain finished before its inner worker could be stopped"
            assert _counter(backend, "fallback") == 1
            await _wait_live(backend, victim)
            again, event = await collect(backend, "after", ids, PARAMS)  # the restarted worker chains again
            assert isinstance(event, FinishEvent) and again == want
            assert _counter(backend, "chained") == attempt + 2  # every attempt and the one after
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


async def _stop_inner_stage(backend, launcher, rid: str) -> str:
    """SIGSTOP the chain's first worker the moment the router starts the chain."""
    deadline = time.monotonic() + 60
    while rid not in backend.runahead.chains:
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    victim = backend.runahead.chains[rid].workers[0]
    os.kill(launcher.pid(victim), signal.SIGSTOP)
    await asyncio.sleep(0.5)  # a stopped stage never sends its prefix: the chain cannot finish
    return victim


async def _wait_live(backend, worker_id: str) -> None:
    deadline = time.monotonic() + 120
    while not any(w.id == worker_id and w.state == "live" and w.load and w.epoch > 1 for w in backend.workers()):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
