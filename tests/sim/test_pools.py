"""Prefill queue, decode batch segments, colocated chunking and the validate orchestration."""

from __future__ import annotations

import pytest

from pdserve.sim.batch import DecodeBatch, segment_s, steps_until
from pdserve.sim.colocated import ColocatedLimits, run_colocated_instance
from pdserve.sim.decode_pool import DecodeLimits, run_decode_instance
from pdserve.latency.base import ConstantLatency
from pdserve.sim.prefill_pool import PrefillPolicy, run_prefill_pool
from pdserve.latency.profiled import ProfiledLatency

MODEL = ConstantLatency(prefill_ms=10, decode_step_ms=1)


def test_fcfs_batches_respect_count_and_token_limits():
    arrivals = [0.0, 0.001, 0.002, 0.003, 0.004]
    new = [100, 100, 300, 50, 50]
    out = run_prefill_pool(arrivals, range(5), new, [0] * 5, MODEL, 1, PrefillPolicy("fcfs", 3, 250))
    # first batch starts alone at 0; then [1] (300 would exceed 250), then [2], then [3, 4]
    assert out.start_s[0] == 0.0 and out.done_s[0] == pytest.approx(0.010)
    assert out.start_s[1] == pytest.approx(0.010) and out.start_s[2] == pytest.approx(0.020)
    assert out.start_s[3] == out.start_s[4] == pytest.approx(0.030)


def test_sjf_serves_short_prompts_first():
    arrivals = [0.0, 0.001, 0.002, 0.003]
    new = [10, 500, 20, 5]
    out = run_prefill_pool(arrivals, range(4), new, [0] * 4, MODEL, 1, PrefillPolicy("sjf", 1))
    order = sorted(range(4), key=lambda i: out.start_s[i])
    assert order == [0, 3, 2, 1]


def test_idle_instance_never_starts_work_before_it_arrives():
    arrivals = [0.0, 0.0, 0.0, 0.5]
    out = run_prefill_pool(arrivals, range(4), [1] * 4, [0] * 4, MODEL, 2, PrefillPolicy("sjf", 4))
    assert all(s >= a for s, a in zip(out.start_s, arrivals))


def test_pipeline_stages_overlap_prefills():
    class TwoStages(ProfiledLatency):
        pipeline_stages = 2

    pp2 = TwoStages((0.010, 0.0, 0.0), (0.001, 0.0, 0.0))
    out = run_prefill_pool([0.0, 0.0], range(2), [8, 8], [0, 0], pp2, 1, PrefillPolicy())
    assert out.start_s[1] == pytest.approx(0.005) and out.done_s[1] == pytest.approx(0.015)


def test_segments_price_linearly_growing_steps():
    assert segment_s(1.0, 0.5, 4) == pytest.approx(1.0 + 1.5 + 2.0 + 2.5)
    for d0, d1 in ((1.0, 0.0), (1.0, 0.5), (0.01, 0.003)):
        for dt in (0.5, 1.0, 3.3, 40.0):
            k = steps_until(d0, d1, dt)
            assert segment_s(d0, d1, k) >= dt - 1e-12
            assert k == 1 or segment_s(d0, d1, k - 1) < dt


def test_decode_batch_bookkeeping_and_preemption():
    batch = DecodeBatch()
    batch.add(1, context=10, generated=1, remaining=5)
    batch.add(2, context=20, generated=1, remaining=2)
    batch.advance(2)
    assert batch.context_sum == 10 + 20 + 4 and batch.pop_finished() == [2]
    batch.add(3, context=5, generated=1, remaining=9)
    assert batch.preempt_newest() == (3, 1)
    assert batch.size == 1 and batch.context_sum == 12 and batch.steps_to_next_finish() == 3


def test_decode_instance_tpot_equals_the_step_when_alone():
    run = run_decode_instance([0.0, 10.0], [0, 1], [10, 10], [5, 5], MODEL, DecodeLimits())
    assert run.finish_s[0] == pytest.approx(0.004) and run.finish_s[1] == pytest.approx(10.004)


def test_colocated_chunking_spreads_a_long_prompt():
    limits = ColocatedLimits(chunk_tokens=100, max_seqs=8)
    run = run_colocated_instance([0.0], [0], [350], [3], [0], MODEL, limits)
    # 4 iterations of 100, 100, 100, 50 rows cost 350/350 of one prefill; then 2 decode steps
    assert run.first_token_s[0] == pytest.approx(0.010)
    assert run.finish_s[0] == pytest.approx(0.012)


def test_colocated_cuts_prompts_where_the_engine_does():
    """As engine/scheduler.py: chunks end on multiples of the budget, and a step's first chunk runs
    whole past the room decode rows leave; a later prompt starts only if its chunk fits whole."""
    model = ProfiledLatency((0.01, 0.0, 0.0), (0.001, 0.0, 0.0))  # every iteration with prompt rows: 10 ms
    limits = ColocatedLimits(chunk_tokens=100)
    run = run_colocated_instance([0.0, 0.0105], [0, 1], [10, 200], [50, 2], [0, 0], model, limits)
    # request 1 arrives during a decode step (ends 0.011), then two iterations of 100 rows each
    # (budget-sized 99-row chunks would take three)
    assert run.first_token_s == {0: pytest.approx(0.010), 1: pytest.approx(0.031)}
    per_row = ProfiledLatency((0.01, 1e-4, 0.0), (0.001, 0.0, 0.0))
    both = run_colocated_instance([0.0, 0.0], [0, 1], [60, 60], [2, 2], [0, 0], per_row, limits)
    # 60 + 60 > 100: the second prompt waits for the next iteration (60 prompt rows + 1 decode row)
    # instead of running 40 rows in the first
    assert both.first_token_s == {0: pytest.approx(0.016), 1: pytest.approx(0.016 + 0.0161)}


def test_prefix_hits_skip_prefill_rows():
    limits = ColocatedLimits(chunk_tokens=64)
    model = ProfiledLatency((0.0, 1e-3, 0.0), (0.001, 0.0, 0.0))
    cold = run_colocated_instance([0.0], [0], [200], [2], [0], model, limits)
    warm = run_colocated_instance([0.0], [0], [200], [2], [150], model, limits)
    assert warm.first_token_s[0] < cold.first_token_s[0] / 3


def test_validate_reports_a_server_that_does_not_come_up(monkeypatch):
    from pdserve.validate import run as vrun
    from pdserve.validate import runtime as v

    monkeypatch.setattr(v.LocalConfig, "serve_args", lambda self, model, port: ["no-such-command"])
    rows = vrun.validate([v.LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=3.0)], "tiny", [])
    assert rows[0]["predicted_goodput_rps"] == 3.0
    assert "server did not come up" in rows[0]["error"]


def test_prefill_first_unmixed_runs_prompts_whole_while_decodes_wait():
    """DistServe's colocated baseline (vLLM 0.2): a waiting prompt runs whole in an iteration of its
    own, and the decode batch makes no progress during it."""
    model = ProfiledLatency((0.01, 0.0, 0.0), (0.001, 0.0, 0.0))  # a prompt iteration 10 ms, a decode step 1 ms
    unmixed = ColocatedLimits(chunk_tokens=100, mixed=False)
    # request 0 decodes from 0.010; request 1 (300 tokens, past the budget: runs whole as the first) arrives at 0.0125
    run = run_colocated_instance([0.0, 0.0125], [0, 1], [50, 300], [6, 2], [0, 0], model, unmixed)
    # request 0: first token 0.010, decode steps end 0.011, 0.012, 0.013 (request 1 waits for it), then the
    # 10 ms prompt iteration [0.013, 0.023] stalls it; its last 2 steps end 0.024, 0.025
    assert run.first_token_s == {0: pytest.approx(0.010), 1: pytest.approx(0.023)}
    assert run.finish_s == {0: pytest.approx(0.025), 1: pytest.approx(0.024)}
    mixed = run_colocated_instance([0.0, 0.0125], [0, 1], [50, 300], [6, 2], [0, 0], model, ColocatedLimits(chunk_tokens=100))
    # mixed: request 1's three 100-row chunks (10 ms each here) each carry request 0's decode row, so
    # request 0 finishes inside them (tokens 5 and 6 at 0.023, 0.033)
    assert mixed.first_token_s[1] == pytest.approx(0.013 + 0.030)
    assert mixed.finish_s[0] == pytest.approx(0.033)
