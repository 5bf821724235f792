"""DistServe's two search rules as options: the decode token cap and one prefill + one decode
instance per node segment (`candidates.DecodeTokenCap`, `segment_pairs.py`). Exact, and cheap:
constant latency models and hand-made scores."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.bench.metrics import Slo
from pdserve.latency.base import ConstantLatency
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import load_hardware
from pdserve.latency.roofline import RooflineLatency
from pdserve.search.candidates import DecodeTokenCap, Parallel, WorkloadShape, decode_bound
from pdserve.search.phase_search import Score, SearchSpace
from pdserve.search.segment_pairs import SegmentPair, score_pairs, segment_pairs
from pdserve.sim.decode_pool import DecodeLimits, run_decode_instance


def test_cap_holds_the_batch_per_stage_and_memory_still_binds():
    opt13, a100 = load_model_spec("opt-13b"), load_hardware("a100-80g")
    tp1, tp4pp2 = RooflineLatency(opt13, a100, 1, 1), RooflineLatency(opt13, a100, 4, 2)
    assert tp1.kv_capacity_tokens < 60_000  # one A100 holds less than 50k x 1.2 beside OPT-13B
    assert DecodeTokenCap(tp1, 50_000).kv_capacity_tokens == min(tp1.kv_capacity_tokens, 50_000)
    assert DecodeTokenCap(tp4pp2, 50_000).kv_capacity_tokens == 100_000  # every stage batches on its own
    assert tp4pp2.kv_capacity_tokens > 100_000
    capped = DecodeTokenCap(tp4pp2, 50_000)
    assert capped.decode_step_s(64, 64_000) == tp4pp2.decode_step_s(64, 64_000)  # times are the inner model's
    assert capped.decode_segment_s(64, 64_000) == tp4pp2.decode_segment_s(64, 64_000)
    assert capped.prefill_s(607) == tp4pp2.prefill_s(607)
    assert capped.prefill_stage_s(0.05) == tp4pp2.prefill_stage_s(0.05)
    assert capped.pipeline_stages == 2 and capped.kv_bytes_per_token == tp4pp2.kv_bytes_per_token
    assert capped.to_dict() == {**tp4pp2.to_dict(), "decode_token_cap": 50_000}


def test_cap_sizes_the_decode_bound_and_the_simulated_batch():
    model = ConstantLatency(prefill_ms=10, decode_step_ms=10)  # unbounded K/V
    capped = DecodeTokenCap(model, 1_000)
    shape = WorkloadShape(mean_prompt=90.0, mean_output=10.0, max_tokens=100, decode_context=95.0)
    slo = Slo(ttft_s=1.0, tpot_s=1.0)
    # 256 sequences without the cap, 1,000 / 95 = 10 with it (a steady sequence holds 90 + 10 / 2);
    # each needs 9 steps of 10 ms
    assert decode_bound(model, shape, slo, 256) == pytest.approx(256 / 0.09)
    assert decode_bound(capped, shape, slo, 256) == pytest.approx(10 / 0.09)
    # 30 requests of 90 + 10 tokens all ready at 0: ten at a time, 3 rounds of 10 steps
    run = run_decode_instance([0.0] * 30, list(range(30)), [90] * 30, [11] * 30, capped,
                              DecodeLimits(256, capped.kv_capacity_tokens))
    assert max(run.finish_s.values()) == pytest.approx(3 * 10 * 0.010) and run.num_preempted == 0


def _score(phase: str, tp: int, pp: int, rps: float) -> Score:
    return Score(phase, Parallel(tp, pp), rps, rps, "simulated")


def test_pairs_share_one_node_per_segment():
    prefill = [_score("prefill", 2, 1, 10.0), _score("prefill", 1, 2, 12.0), _score("prefill", 8, 1, 40.0),
               _score("prefill", 4, 1, 0.0)]
    decode = [_score("decode", 1, 1, 6.0), _score("decode", 2, 2, 16.0), _score("decode", 4, 3, 30.0)]
    labels = {(p.label, round(p.bound_rps, 3)) for p in segment_pairs(prefill, decode, 8, 8)}
    # one node: 2+1, 2+4, 1x2+1, 1x2+4 GPUs; TP8 + anything is 9 > 8; the TP4 prefill has no goodput;
    # D tp4pp3 (12 GPUs) needs 3 segments, more than one node has
    assert labels == {("P tp2pp1 + D tp1pp1 (1 seg)", 6.0), ("P tp2pp1 + D tp2pp2 (1 seg)", 10.0),
                      ("P tp1pp2 + D tp1pp1 (1 seg)", 6.0), ("P tp1pp2 + D tp2pp2 (1 seg)", 12.0)}
    on_four_nodes = {p.label for p in segment_pairs(prefill, decode, 8, 32)}
    assert "P tp1pp2 + D tp2pp2 (2 seg)" in on_four_nodes  # 1 + 2 GPUs a node, two nodes
    assert "P tp8pp1 + D tp1pp1 (1 seg)" not in on_four_nodes  # a segment never spans nodes
    assert not any("tp4pp3" in label for label in on_four_nodes)  # 3 segments do not divide pp 1 or 2
    ranked = segment_pairs(prefill, decode, 8, 8)
    assert [p.bound_rps / p.gpus for p in ranked] == sorted((p.bound_rps / p.gpus for p in ranked), reverse=True)


def test_score_pairs_simulates_end_to_end_and_prunes_by_the_slower_phase(make_requests):
    model = ConstantLatency(prefill_ms=100, decode_step_ms=10)  # prefill: 10 rps an instance
    requests = make_requests(200, prompt=64, output=20, seed=3)
    hw, spec = load_hardware("a100-80g"), load_model_spec("opt-13b")
    space = SearchSpace(spec, hw, requests, requests, Slo(ttft_s=1.0, tpot_s=0.05), fixed_model=model)
    fast, slow = _score("prefill", 1, 1, 10.0), _score("decode", 1, 1, 1.0)
    pairs = [SegmentPair(fast, _score("decode", 1, 1, 10.0), 1, 10.0), SegmentPair(fast, slow, 1, 1.0)]
    scored = score_pairs(space, pairs)
    assert [p.status for p in scored] == ["simulated", "pruned"]
    best = scored[0]
    # a 100 ms prefill and Poisson arrivals: the pair is prefill-bound below 10 rps
    assert 0 < best.goodput_rps < 10.0 and best.per_gpu == best.goodput_rps / 2
    assert best.joint_at_goodput >= 0.9
    assert dataclasses.replace(best, goodput_rps=0.0).per_gpu == 0.0


def test_a_pair_scores_at_most_its_slower_instances_sustained_rate(make_requests):
    # decode: 4 sequences a 10 ms step, 10 steps a request, 40 rps sustained; a 5 s TPOT spread over 10
    # tokens lets a 2,048-request run pass well above that (issue 40)
    model = ConstantLatency(prefill_ms=1, decode_step_ms=10)
    requests = make_requests(2048, prompt=64, output=11, seed=1)
    hw, spec = load_hardware("a100-80g"), load_model_spec("opt-13b")
    space = SearchSpace(spec, hw, requests, requests, Slo(ttft_s=1.0, tpot_s=5.0), max_seqs=4, fixed_model=model)
    prefill = Score("prefill", Parallel(1, 1), 1000.0, 1000.0, "simulated")
    decode = Score("decode", Parallel(1, 1), 40.0, 40.0, "simulated")
    [pair] = score_pairs(space, [SegmentPair(prefill, decode, 1, 40.0)])
    assert pair.status == "simulated" and pair.goodput_rps == pytest.approx(40.0)
    assert pair.joint_at_goodput >= 0.9
