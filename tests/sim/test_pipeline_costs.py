"""Pipeline parallelism with its costs in the roofline model (issue 24, part 2)."""

from __future__ import annotations

import pytest

from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import load_hardware
from pdserve.latency.roofline import RooflineLatency


@pytest.fixture(scope="module")
def shapes():
    spec, hw = load_model_spec("llama-70b-class"), load_hardware("h100")
    return hw, {(tp, pp): RooflineLatency(spec, hw, tp, pp) for tp in (2, 8) for pp in (1, 4)}


def test_decode_cycle_is_one_micro_batch_through_the_stack_plus_an_overhead_per_micro_batch(shapes):
    hw, m = shapes
    tp2pp4, tp2 = m[(2, 4)], m[(2, 1)]
    # a batch of 64 in 4 micro-batches of 16: the cycle is a 16-sequence full-stack step (+ 4 hops) ...
    expected = tp2pp4.iteration_s(16, 16 * 2000, 16 * 2000 + 16, "generation") + 3 * hw.step_overhead_s
    assert tp2pp4.decode_step_s(64, 64 * 2000) == pytest.approx(expected)
    # ... so four times the GPUs give no faster token than TP2 alone (memory-bound: same weights per GPU-stage read)
    assert tp2pp4.decode_step_s(1, 2000) > tp2.decode_step_s(1, 2000)
    assert tp2pp4.pipeline_overhead_s == 3 * hw.step_overhead_s and tp2.pipeline_overhead_s == 0


def test_a_colocated_chunk_paces_the_pipeline(shapes):
    hw, m = shapes
    tp2pp4 = m[(2, 4)]
    chunk, pairs, kv, batch, context = 1024, 1024 * 1025 // 2, 2 * 1024, 64, 64 * 2000
    step = tp2pp4.mixed_step_s(chunk, pairs, kv, 0.5, batch, context)
    # the chunk's GEMMs and attention, plus a quarter of the decodes' attention (their own kernels)
    heaviest = tp2pp4.iteration_s(chunk + 16, pairs, kv) + tp2pp4.attention_s(context / 4, (context + batch) / 4)
    assert step == pytest.approx(heaviest + 3 * hw.step_overhead_s)
    # the old model spread the chunk over the stages: a quarter of the rows per micro-batch
    spread = tp2pp4.iteration_s((chunk + batch) / 4, (pairs + context) / 4, (kv + context + batch) / 4)
    assert step > 2 * spread


def test_pipeline_no_longer_beats_tensor_parallel_on_the_same_gpus(shapes):
    _, m = shapes
    tp8, tp2pp4 = m[(8, 1)], m[(2, 4)]
    chunk, pairs, kv = 1024, 1024 * 1025 // 2, 2 * 1024
    for batch in (1, 32, 128):
        context = batch * 3000
        assert tp2pp4.mixed_step_s(chunk, pairs, kv, 0.25, batch, context) > tp8.mixed_step_s(chunk, pairs, kv, 0.25, batch, context)
        assert tp2pp4.decode_step_s(batch, context) > tp8.decode_step_s(batch, context)
    assert tp2pp4.prefill_s(4000) > tp8.prefill_s(4000)
    assert tp2pp4.kv_capacity_tokens == tp8.kv_capacity_tokens  # same GPUs, same memory


def test_without_pipeline_nothing_changes(shapes):
    _, m = shapes
    tp2 = m[(2, 1)]
    assert tp2.mixed_step_s(512, 512 * 513 // 2, 1024, 0.5, 8, 8000) == tp2.iteration_s(520, 512 * 513 // 2, 1024) + tp2.attention_s(8000, 8008)
    assert tp2.decode_step_s(8, 8000) == tp2.iteration_s(8, 8000, 8008, "generation")
