"""A prefill or decode instance scores at most the rate it sustains (`phase_search.score_all`,
`candidates.prefill_bound` / `decode_bound`, issue 40): a finite run passes an overloaded
instance where its queue's wait fits a loose TTFT, or spreads over every output token inside a
loose TPOT. Constant latency models, so every capacity is exact."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pytest

from pdserve.bench.metrics import Slo
from pdserve.latency.base import ConstantLatency, LatencyModel
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import load_hardware
from pdserve.search.candidates import Parallel, WorkloadShape, decode_bound, prefill_bound, tpot_batch
from pdserve.search.phase_search import SearchSpace, score_all
from pdserve.sim.requests import SimRequests


def _space(model, requests, slo: Slo, max_seqs: int = 256) -> SearchSpace:
    hw, spec = load_hardware("a100-80g"), load_model_spec("opt-13b")
    return SearchSpace(spec, hw, requests, requests, slo, max_seqs=max_seqs, fixed_model=model)


def _score(space: SearchSpace, phase: str):
    [score] = score_all(space, phase, [(Parallel(1, 1), 0)], lambda _msg: None)
    return score


def test_an_overloaded_decode_instance_scores_its_sustained_rate(make_requests):
    # 4 sequences a step of 10 ms, 10 steps a request: 40 rps at most. At 60 rps, 2,048 requests
    # leave a backlog of about 700 (an 18 s wait) that a 5 s TPOT spread over 10 tokens still passes.
    model = ConstantLatency(prefill_ms=1, decode_step_ms=10)
    score = _score(_space(model, make_requests(2048, prompt=64, output=11, seed=1), Slo(ttft_s=1.0, tpot_s=5.0), 4),
                   "decode")
    assert score.status == "simulated" and score.bound_rps == pytest.approx(40.0)
    assert max(rate for rate, at in score.points if at.tpot >= 0.9) > 50  # the finite run passes above it
    assert score.goodput_rps == pytest.approx(40.0)


def test_an_overloaded_prefill_instance_scores_its_sustained_rate(make_requests):
    # one 5 ms prompt at a time: 200 rps. At 300 rps, 2,048 requests' backlog waits at most 3.4 s: inside 10 s.
    model = ConstantLatency(prefill_ms=5, decode_step_ms=10)
    score = _score(_space(model, make_requests(2048, prompt=64, output=11, seed=1), Slo(ttft_s=10.0, tpot_s=1.0)),
                   "prefill")
    assert score.bound_rps == pytest.approx(200.0)
    assert max(rate for rate, at in score.points if at.ttft >= 0.9) > 250
    assert score.goodput_rps == pytest.approx(200.0)


def test_a_tight_slo_scores_below_the_sustained_rate(make_requests):
    # a 100 ms TTFT against a 5 ms prompt: the queue, not the capacity, decides (unchanged by the cap)
    model = ConstantLatency(prefill_ms=5, decode_step_ms=10)
    score = _score(_space(model, make_requests(2048, prompt=64, output=11, seed=1), Slo(ttft_s=0.1, tpot_s=1.0)),
                   "prefill")
    assert 100 < score.goodput_rps < 0.99 * score.bound_rps


def test_steady_decode_context_weights_each_request_by_its_steps():
    shape = WorkloadShape.of(SimRequests((0.0, 1.0), (100, 100), (11, 101), (0, 0)))
    assert shape.mean_output == 56.0
    # 10 steps at 100 + 11/2 and 100 steps at 100 + 101/2: the long request is in the batch 10x as long
    assert shape.decode_context == pytest.approx((10 * 105.5 + 100 * 150.5) / 110)


def test_the_tpot_batch_fits_the_steady_kv():
    # K/V for 1,000 tokens; a steady sequence holds 90 + 10 / 2 = 95 of them: 10 fit (reserving all
    # 100 would give 10 too, 950 would not: 10 against 9)
    shape = WorkloadShape(mean_prompt=90.0, mean_output=10.0, max_tokens=100, decode_context=95.0)
    model = ConstantLatency(prefill_ms=1, decode_step_ms=10, kv_capacity_tokens=1_000)
    assert tpot_batch(model, shape, Slo(ttft_s=1.0, tpot_s=1.0), 256) == 10
    shape = WorkloadShape(mean_prompt=900.0, mean_output=200.0, max_tokens=1_100, decode_context=1_000.0)
    model = ConstantLatency(prefill_ms=1, decode_step_ms=10, kv_capacity_tokens=10_000)
    assert tpot_batch(model, shape, Slo(ttft_s=1.0, tpot_s=1.0), 256) == 10  # 10,000 / 1,100 would give 9
    assert decode_bound(model, shape, Slo(ttft_s=1.0, tpot_s=1.0), 256) == pytest.approx(10 / (199 * 0.010))


@dataclass(frozen=True)
class _BatchedPrefill(LatencyModel):
    """A batch of k prompts takes 50 ms + 10 ms a prompt (the fixed part shared)."""

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        return 0.050 + 0.010 * len(new_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return 0.010

    def mixed_step_s(self, *args) -> float:
        return 0.010

    def to_dict(self) -> dict:
        return {"kind": "test"}


def test_a_batched_prefill_sustains_its_largest_batch_within_the_ttft():
    shape = WorkloadShape(mean_prompt=100.0, mean_output=10.0, max_tokens=110, decode_context=105.0)
    slo = Slo(ttft_s=0.5, tpot_s=1.0)
    assert prefill_bound(_BatchedPrefill(), shape, slo)[0] == pytest.approx(1 / 0.06)  # one prompt a batch
    assert prefill_bound(_BatchedPrefill(), shape, slo, max_batch=1_000_000)[0] == pytest.approx(45 / 0.5)
    assert prefill_bound(_BatchedPrefill(), shape, slo, max_batch=8)[0] == pytest.approx(8 / 0.13)
    assert prefill_bound(_BatchedPrefill(), shape, slo, 1_000, max_batch_tokens=2_000)[0] == pytest.approx(20 / 0.25)


@dataclass(frozen=True)
class _TiledDecode(LatencyModel):
    """A decode step of 10 ms up to 128 sequences and 20 ms past them (a GEMM tile boundary)."""

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        return 0.001

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return 0.010 if batch <= 128 else 0.020

    def mixed_step_s(self, *args) -> float:
        return 0.010

    def to_dict(self) -> dict:
        return {"kind": "test"}


def test_the_decode_bound_is_the_best_rate_within_the_tpot_batch():
    # 200 sequences meet a 25 ms TPOT but carry 200 / 0.020 = 10,000 tokens/s; 128 carry 12,800. A pool
    # under load settles at the smallest batch whose rate reaches the arrivals, so it sustains 128's rate
    shape = WorkloadShape(mean_prompt=100.0, mean_output=11.0, max_tokens=111, decode_context=105.5)
    slo = Slo(ttft_s=1.0, tpot_s=0.025)
    model = _TiledDecode()
    assert tpot_batch(model, shape, slo, 200) == 200
    assert decode_bound(model, shape, slo, 200) == pytest.approx(128 / (10 * 0.010))
