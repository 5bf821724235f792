"""Workers with tensor parallelism served end to end (tiny model, fp32): prefill TP 2 -> decode TP 1,
TP 1 -> TP 2 and colocated TP 2 give the tokens of a TP 1 engine (fp32, where the row-parallel
sums' rounding does not flip a choice: on these prompts it does not); each TP worker runs its
followers; pools and holds end empty."""

from __future__ import annotations

import asyncio
import os

import pytest

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
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
