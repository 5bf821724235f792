"""Workers with tensor parallelism served end to end (tiny model, fp32): prefill TP 2 -> decode TP 1,
TP 1 -> TP 2 and colocated TP 2 give the tokens of a TP 1 engine (fp32, where the row-parallel
sums' rounding does not flip a choice: on these prompts it does not); each TP worker runs its
followers; pools and holds end empty; a killed TP worker leaves no follower and comes back; a
KV-Runahead chain over two TP 2 prefill workers and a prefix fetch into a TP 2 pool give the TP 1
tokens too; a TP 2 worker's heartbeats carry its collective seconds and the router prices it from
them."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.supervisor import RestartPolicy
from pdserve.workers.process.tp_rank import TpShape
from tests.runtime.conftest import collect, config, prompt, wait_baseline
from tests.runtime.test_kv_index_runtime import until

FP32 = EngineConfig(model="tiny", dtype="float32", kv_cache_bytes=48 << 20)


@pytest.fixture(scope="module")
def reference_engine():
    return Engine(EngineConfig(model="tiny", dtype="float32", num_blocks=256, num_threads=1))


def followers(pid: int) -> list[int]:
    """Live processes started by `pid` through multiprocessing's spawn (its TP followers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in _cmdline(entry):
                out.append(int(entry))
    return out


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return b""


CASES = [(20, 0.0), (300, 0.0), (61, 0.8)]


@pytest.mark.parametrize("mode,tp,workers", [  # prefill TP 2 -> decode TP 1: the runahead test below
    ("disaggregated", TpShape(prefill=1, decode=2), {"prefill-0": 1, "decode-0": 2}),
    ("colocated", TpShape(other=2), {"colocated-0": 2}),
], ids=["p1-d2", "colocated-2"])
def test_tp_workers_serve_the_tokens_of_tp1(reference_engine, mode, tp, workers):
    async def main():
        cfg = config(engine=FP32, mode=mode, replicas=1, tp=tp, transport="auto")
        async with cluster(cfg) as (backend, launcher):
            assert {w.id: w.tp for w in backend.workers()} == workers  # /workers rows
            pricing = backend.router.config.pricing  # the router prices each worker at its registered size
            assert all(backend.router.worker_cost(wid) is pricing.worker(ranks) for wid, ranks in workers.items())
            for wid, ranks in workers.items():
                assert len(followers(launcher.pid(wid))) == ranks - 1  # ranks 1..N-1
            cases = [(prompt(n, 70 + i), SamplingParams(max_tokens=16, ignore_eos=True, temperature=t, seed=3 + i))
                     for i, (n, t) in enumerate(CASES)]
            results = await asyncio.gather(*(collect(backend, f"t{i}", p, s) for i, (p, s) in enumerate(cases)))
            for (ids, event), (p, s) in zip(results, cases):
                assert isinstance(event, FinishEvent) and event.finish_reason == "length"
                assert ids == list(reference_engine.generate([list(p)], s)[0].output_ids)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            await _priced_from_own_collectives(backend, workers)

    asyncio.run(main())


async def _priced_from_own_collectives(backend, workers: dict[str, int]) -> None:
    """Each TP 2 worker's heartbeats carried its rank 0's collective seconds: after its 15+ decode
    steps the router prices it from them (router/pricing/live_collectives.py), /workers and the gauge show
    them; a TP 1 worker has none."""
    live = backend.router.live
    for wid, ranks in workers.items():
        if ranks == 1:
            assert live.cost(wid) is None and live.view(wid) == {}
            continue
        decode = (await until(lambda: live.view(wid).get("decode", {}).get("live") and live.view(wid)))["decode"]
        assert decode["steps"] >= 15 and decode["step_ms"] > 0 and live.num_ignored == {}
        assert backend.router.worker_cost(wid) is live.cost(wid) != backend.router.config.pricing.worker(ranks)
        (row,) = [w for w in backend.workers() if w.id == wid]
        assert row.load["collectives"]["decode"]["steps"] >= 15
        assert f'pdserve_tp_live_collective_seconds{{phase="decode",term="step",worker="{wid}"}}' in backend.metrics_text().decode()


def test_killed_tp_worker_leaves_no_followers_and_comes_back(reference_engine):
    """kill -9 a TP 2 prefill worker: its follower exits with it, the supervisor starts the worker
    again under its next epoch (with a new follower) and it serves the TP 1 engine's tokens."""
    async def main():
        cfg = config(engine=FP32, tp=TpShape(prefill=2, decode=1), transport="auto",
                     restart=RestartPolicy(first_delay_s=0.2, max_delay_s=1.0))
        async with cluster(cfg) as (backend, launcher):
            old_pid = launcher.pid("prefill-0")
            (old_follower,) = followers(old_pid)
            launcher.kill("prefill-0")
            deadline = time.monotonic() + 30
            while _running(old_follower):
                assert time.monotonic() < deadline, "the follower outlived its worker"
                await asyncio.sleep(0.05)
            while not any(w.id == "prefill-0" and w.epoch == 2 and w.state == "live" and w.load for w in backend.workers()):
                assert time.monotonic() < deadline + 120
                await asyncio.sleep(0.1)
            assert len(followers(launcher.pid("prefill-0"))) == 1
            p, s = prompt(280, 9), SamplingParams(max_tokens=8, ignore_eos=True)
            ids, event = await collect(backend, "after-kill", p, s)
            assert isinstance(event, FinishEvent) and ids == list(reference_engine.generate([list(p)], s)[0].output_ids)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


RUNAHEAD = EngineConfig(model="tiny", dtype="float32", kv_cache_bytes=48 << 20, max_num_batched_tokens=64)


def test_runahead_chain_and_prefix_fetch_into_tp2_prefill_workers():
    """Two TP 2 prefill workers and a TP 1 decode worker (fp32): the CASES (greedy and sampled)
    hand off TP 2 -> TP 1; a 320-token prompt runs as a KV-Runahead chain over both TP 2 workers;
    a second turn's prefill worker fetches the answer's blocks from the decode worker into its
    TP 2 pool. Tokens equal a TP 1 engine's; pools at baseline."""
    reference = Engine(EngineConfig(**{**RUNAHEAD.__dict__, "num_threads": 1, "num_blocks": 256}))
    long_prompt, history = prompt(320, 1), prompt(96, 11)  # 5 chunks of 64; six full blocks
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    answer = SamplingParams(max_tokens=40, ignore_eos=True)

    def want(ids, params):
        return list(reference.generate([list(ids)], params)[0].output_ids)

    async def main():
        cfg = config(engine=RUNAHEAD, num_prefill=2, tp=TpShape(prefill=2, decode=1), transport="auto",
                     prefill_runahead=2, runahead_min_tokens=300)
        async with cluster(cfg) as (backend, launcher):
            assert {w.id: w.tp for w in backend.workers()} == {"prefill-0": 2, "prefill-1": 2, "decode-0": 1}
            assert all(len(followers(launcher.pid(w))) == 1 for w in ("prefill-0", "prefill-1"))
            assert followers(launcher.pid("decode-0")) == []
            cases = [(prompt(n, 70 + i), SamplingParams(max_tokens=16, ignore_eos=True, temperature=t, seed=3 + i))
                     for i, (n, t) in enumerate(CASES)]
            results = await asyncio.gather(*(collect(backend, f"c{i}", p, s) for i, (p, s) in enumerate(cases)))
            for (ids, event), (p, s) in zip(results, cases):
                assert isinstance(event, FinishEvent) and ids == want(p, s)
            chained, event = await collect(backend, "chain", long_prompt, greedy)
            assert isinstance(event, FinishEvent) and chained == want(long_prompt, greedy)
            first, _ = await collect(backend, "t1", history, answer)
            keys = backend._block_hashes(history + tuple(first[:-1]))  # 135 computed tokens: 8 blocks
            await until(lambda: all(backend.router.kv_holders(k) for k in keys))
            turn2 = history + tuple(first) + prompt(20, 12)
            second, event = await collect(backend, "t2", turn2, greedy)
            assert isinstance(event, FinishEvent)
            assert (first, second) == (want(history, answer), want(turn2, greedy))
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            return {line["request_id"]: line for line in backend.trace.recent}

    lines = asyncio.run(main())
    assert sorted(lines["chain"]["runahead_workers"]) == ["prefill-0", "prefill-1"]
    t2 = lines["t2"]
    # The prefill worker that computed turn 1 holds its six prompt blocks and fetches the answer's
    # two; the other one (jsq may pick it: it places by load reports, which can lag) fetches all 8.
    held = 6 if t2["prefill"] == lines["t1"]["prefill"] else 0
    assert (t2["fetch"], t2["fetch_holder"], t2["fetch_landed_blocks"]) == ("fetch", "decode-0", 8 - held), t2
    assert t2["prefill"] in ("prefill-0", "prefill-1") and t2["cached_tokens"] == 8 * 16
