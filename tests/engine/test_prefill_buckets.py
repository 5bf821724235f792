"""Length-bucketed prefill admission: the pure choice, and a scheduler step's composition with
and without buckets (the queue head always goes first; short prompts share a step)."""

from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.prefill_buckets import length_bucket, next_admission, validate_bounds
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import SamplingParams, Sequence

import pytest


def test_length_bucket_and_next_admission():
    bounds = (0, 16, 64)
    assert [length_bucket(n, bounds) for n in (0, 15, 16, 63, 64, 10_000)] == [0, 0, 1, 1, 2, 2]
    assert next_admission([40, 12, 12], None, bounds) == 0  # nothing admitted yet: the head
    assert next_admission([40, 12, 12], 0, bounds) == 1  # the oldest in the step's bucket
    assert next_admission([40, 50], 0, bounds) == 0  # none in it: the head (work-conserving)
    assert next_admission([40, 12], 0, ()) == 0
    validate_bounds((0, 16))
    with pytest.raises(ValueError):
        validate_bounds((1, 16))


def _step_prompts(buckets: tuple[int, ...]) -> list[list[str]]:
    blocks = BlockManager(64, 16, "m")
    sched = Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, prefill_length_buckets=buckets))
    for i, (name, n) in enumerate([("A", 10), ("B", 40), ("C", 12), ("D", 12)]):
        sched.add(Sequence(name, tuple(range(1, n + 1)), SamplingParams(max_tokens=1), 0, arrival=i))
    steps = []
    for _ in range(3):
        plan = sched.schedule()
        steps.append([seq.request_id for seq, _ in plan.prefill])
        for seq, rows in plan.prefill:  # the step ran: the prompts' rows are computed
            seq.num_computed += rows
    return steps


def test_buckets_group_short_prompts_in_a_step_after_the_head():
    assert _step_prompts(())[:2] == [["A"], ["B"]]  # FCFS: B's 40 rows do not fit beside A; C, D wait behind it
    assert _step_prompts((0, 16, 64))[:2] == [["A", "C", "D"], ["B"]]  # A first, then its bucket's prompts
