"""The per-request P/D decision end to end (tiny model, 1P1D): a request's tokens are the same
whichever way it was decided, a local prefill moves no K/V, and each decision is on the trace
line, in `pdserve_pd_decisions_total` and (its load) in `/workers`."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline

CASES = [(prompt(n, 60 + i), SamplingParams(max_tokens=10, ignore_eos=True, temperature=t, seed=3 + i))
         for i, (n, t) in enumerate([(17, 0.0), (300, 0.8), (90, 0.0)])]
EXPECTED_LABEL = {"always": "disaggregate", "never": "local"}


@pytest.fixture(scope="module")
def expected():
    engine = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    return [list(engine.generate([list(p)], s)[0].output_ids) for p, s in CASES]


async def _serve(mode: str) -> tuple[list[list[int]], list[dict], str, list]:
    async with cluster(config(pd_decision=mode)) as (backend, _):
        results = await asyncio.gather(*(collect(backend, f"{mode}{i}", p, s) for i, (p, s) in enumerate(CASES)))
        assert all(isinstance(event, FinishEvent) for _, event in results)
        views = await wait_baseline(backend)
        backend.router.assert_no_leaks()
        return [ids for ids, _ in results], list(backend.trace.recent), backend.metrics_text().decode(), views


@pytest.mark.parametrize("mode", ["always", "never"])
def test_tokens_are_the_same_whichever_way_the_decision_goes(expected, mode):
    tokens, lines, metrics, views = asyncio.run(_serve(mode))
    assert tokens == expected
    assert [line["pd_decision"] for line in lines] == [EXPECTED_LABEL[mode]] * len(CASES)
    assert all((line["prefill"] == line["decode"]) == (mode == "never") for line in lines)
    assert f'pdserve_pd_decisions_total{{decision="{EXPECTED_LABEL[mode]}"}} 3.0' in metrics
    moved = next(line for line in metrics.splitlines() if line.startswith("pdserve_kv_transfer_bytes_total "))
    assert (float(moved.split()[1]) > 0) == (mode == "always")
    decode = next(v for v in views if v.role == "decode")
    assert decode.load["local_prefills"] == 0 and decode.load["local_prefill_tokens"] == 0  # all done


def test_margin_decides_each_request_and_writes_its_terms(expected):
    tokens, lines, metrics, _ = asyncio.run(_serve("margin"))
    assert tokens == expected
    for line in lines:
        assert line["pd_decision"] in ("disaggregate", "local") and line["pd_reason"] in ("margin", "gate")
        for term in ("interference_saved_s", "transfer_exposed_s", "route_delta_s", "failure_penalty_s", "net_margin_s"):
            assert isinstance(line[f"pd_{term}"], float)
    assert "pdserve_pd_decisions_total" in metrics
