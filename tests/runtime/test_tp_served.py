"""Workers with tensor parallelism served end to end (tiny model, fp32): prefill TP 2 -> decode TP 1,
TP 1 -> TP 2 and colocated TP 2 give the tokens of a TP 1 engine (fp32, where the row-parallel
sums' rounding does not flip a choice: on these prompts it does not); each TP worker runs its
followers; pools and holds end empty; a killed TP worker leaves no follower and comes back."""

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
from pdserve.workers.supervisor import RestartPolicy
from pdserve.workers.tp_rank import TpShape
from tests.runtime.conftest import collect, config, prompt, wait_baseline

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


@pytest.mark.parametrize("mode,tp,workers", [
    ("disaggregated", TpShape(prefill=2, decode=1), {"prefill-0": 2, "decode-0": 1}),
    ("disaggregated", TpShape(prefill=1, decode=2), {"prefill-0": 1, "decode-0": 2}),
    ("colocated", TpShape(other=2), {"colocated-0": 2}),
], ids=["p2-d1", "p1-d2", "colocated-2"])
def test_tp_workers_serve_the_tokens_of_tp1(reference_engine, mode, tp, workers):
    async def main():
        cfg = config(engine=FP32, mode=mode, replicas=1, tp=tp, transport="auto")
        async with cluster(cfg) as (backend, launcher):
            assert {w.id: w.tp for w in backend.workers()} == workers  # /workers rows
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

    asyncio.run(main())


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
