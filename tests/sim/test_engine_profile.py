"""`pdserve profile`'s decode points: batches admitted with their context already in K/V, timed
in passes, with the visible context the engine's own step log reports for the timed steps."""

from __future__ import annotations

import pytest

from pdserve.engine.step_log import StepLog, read_steps
from pdserve.latency import engine_profile
from pdserve.latency.engine_profile import DECODE_STEPS, DECODE_WARMUP_ROUNDS, ProfilePlan, decode_points_s


@pytest.mark.timeout(120)
def test_decode_points_are_the_shapes_the_engine_ran(tiny_model_dir, tmp_path):
    plan = ProfilePlan(model=str(tiny_model_dir), prompt_lens=(16,), batches=(1, 3), contexts=(20, 70), repeats=2,
                       threads=1, dtype="float32")
    engine = engine_profile._engine(plan)
    log = tmp_path / "steps.jsonl"
    engine.step_log = StepLog(log)
    points = [(1, 20), (3, 70)]
    measured = decode_points_s(engine, points, repeats=2)
    engine.step_log.close()
    engine.assert_no_leaks()  # every imported batch was released
    steps = read_steps([log])
    passes = DECODE_WARMUP_ROUNDS + 2
    assert len(steps) == passes * len(points) * (1 + DECODE_STEPS)  # no prefill: the context was imported
    assert all(not s.new for s in steps)
    for k, ((batch, context), (b, summed, seconds)) in enumerate(zip(points, measured)):
        timed = [s for p in range(passes) for s in steps[(p * len(points) + k) * (1 + DECODE_STEPS) + 1:]
                 [:DECODE_STEPS]]
        assert {s.batch for s in timed} == {batch} and b == batch
        # the reported context is the mean the timed steps attended over, as the step log counts it
        assert summed == pytest.approx(sum(s.context for s in timed) / len(timed), abs=batch)
        assert seconds > 0
