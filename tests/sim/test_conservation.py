"""Every arrival finishes or is rejected, and simulated times are causal."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import Slo, summarize
from pdserve.latency.base import ConstantLatency
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.requests import REJECTED_KV
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.sim.transfer import LinkSpec

CONFIGS = [
    SimConfig(mode="colocated", replicas=2, chunk_tokens=64, max_decode_seqs=8),
    SimConfig(mode="disaggregated", prefill_replicas=2, decode_replicas=3, prefill=PrefillPolicy("sjf", 4, 256),
              link=LinkSpec(1e6, "layer", 4)),
    SimConfig(mode="disaggregated", prefill=PrefillPolicy("fcfs", 3), link=LinkSpec(5e5, "request")),
]


def _check(result, requests, arrivals):
    assert result.num_arrived == len(requests) == len(result.records)
    assert result.num_finished + result.num_rejected == result.num_arrived
    assert sum(not r.success for r in result.records) == result.num_rejected
    for r, a in zip(result.records, arrivals):
        assert r.arrival_s == a
        if r.success:
            assert 0 <= r.ttft_s <= r.e2e_s
        else:
            assert r.error == REJECTED_KV


@pytest.mark.parametrize("config", CONFIGS, ids=["colocated", "disagg-sjf-layer", "disagg-batch-request"])
def test_conservation_under_memory_pressure(make_requests, config):
    """A tight K/V pool forces preemptions; requests that can never fit are rejected, not lost."""
    requests = make_requests(600, prompt=40, output=30, seed=3, arrival="gamma")
    big = requests.__class__(requests.unit_arrivals_s, tuple(40 if i % 50 else 400 for i in range(600)),
                             requests.output_tokens, requests.cached_tokens)
    model = ConstantLatency(prefill_ms=2, decode_step_ms=1, kv_bytes_per_token=64, kv_capacity_tokens=300)
    result = simulate(big, 200, config, model)
    _check(result, big, big.arrivals_at(200))
    assert result.num_rejected == 12
    assert summarize(result.records, Slo(1, 1))["failure_reasons"] == {REJECTED_KV: 12}


def test_preemption_happens_and_everyone_still_finishes(make_requests):
    requests = make_requests(300, prompt=20, output=60, seed=5)
    model = ConstantLatency(prefill_ms=1, decode_step_ms=1, kv_capacity_tokens=400)
    for config in (SimConfig(mode="colocated", max_decode_seqs=64), SimConfig(max_decode_seqs=64)):
        result = simulate(requests, 500, config, model)
        assert result.num_preempted > 0
        assert result.num_finished == 300
        _check(result, requests, requests.arrivals_at(500))


def test_single_token_outputs_finish_at_prefill(make_requests):
    requests = make_requests(50, prompt=8, output=1)
    result = simulate(requests, 10, SimConfig(), ConstantLatency(prefill_ms=5, decode_step_ms=1))
    assert all(r.e2e_s == r.ttft_s for r in result.records)


def test_trace_with_unsorted_arrivals(tmp_path):
    from pdserve.bench.workload import WorkloadConfig
    from pdserve.bench.arrivals import ArrivalSpec
    from pdserve.sim.requests import build_requests

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(f'{{"prompt_len": 10, "output_len": 5, "arrival_s": {t}}}' for t in (3.0, 1.0, 2.0, 0.0)))
    requests = build_requests(WorkloadConfig(num_requests=0, arrival=ArrivalSpec("trace"), trace_path=str(trace)))
    result = simulate(requests, None, SimConfig(), ConstantLatency(prefill_ms=100, decode_step_ms=10))
    assert [r.arrival_s for r in result.records] == pytest.approx([3.0, 1.0, 2.0, 0.0])
    assert result.num_finished == 4 and all(r.ttft_s >= 0.1 - 1e-9 for r in result.records)
