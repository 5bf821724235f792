"""Splitwise's mixed-machine prompt priority: a fresh prompt displaces young token work only,
the displaced request keeps its capacity and its tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.prompt_priority import PromptPriority, pick_displaced
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import SamplingParams, Sequence, SeqStatus

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def decoding(rid: str, arrival: int, queued_s: float, preemptions: int = 0) -> Sequence:
    seq = Sequence(rid, (1, 2, 3), GREEDY, seed=0, arrival=arrival)
    seq.transition(SeqStatus.RUNNING)
    seq.output_ids.append(7)
    seq.num_computed, seq.queued_s, seq.num_preemptions = 3, queued_s, preemptions
    return seq


POLICY = PromptPriority(age_override_ms=500.0, max_preemptions=2)


def test_a_fresh_token_is_displaced_the_youngest_first():
    old, young = decoding("old", 0, queued_s=99.8), decoding("young", 1, queued_s=99.9)
    assert pick_displaced([old, young], POLICY, now_s=100.0, prompt_pending=True) is young


def test_an_aged_token_runs():
    aged = decoding("aged", 0, queued_s=99.5)  # exactly at the 500 ms override
    assert pick_displaced([aged], POLICY, now_s=100.0, prompt_pending=True) is None


def test_a_token_at_its_preemption_cap_runs():
    capped = decoding("capped", 0, queued_s=99.99, preemptions=2)
    assert pick_displaced([capped], POLICY, now_s=100.0, prompt_pending=True) is None
    assert pick_displaced([decoding("once", 0, 99.99, 1)], POLICY, 100.0, True) is not None


def test_without_prompt_work_nothing_is_displaced():
    assert pick_displaced([decoding("t", 0, 99.99)], POLICY, now_s=100.0, prompt_pending=False) is None


def scheduler(max_num_seqs: int, policy: PromptPriority | None, clock: Clock) -> Scheduler:
    blocks = BlockManager(num_blocks=32, block_size=4, identity="test")
    return Scheduler(blocks, SchedulerConfig(max_num_seqs, 64, 256, policy), clock=clock)


def fill_with_decodes(sched: Scheduler, clock: Clock, n: int) -> list[Sequence]:
    seqs = [Sequence(f"d{i}", (5, 6, 7, 8, 9), GREEDY, seed=0, arrival=i) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
        clock.now_s += 0.01
    plan = sched.schedule()
    for seq, rows in plan.prefill:  # the prompt is computed and its first token sampled
        seq.num_computed += rows
        seq.output_ids.append(1)
    assert all(s.is_decoding for s in seqs)
    return seqs


def test_a_full_batch_yields_one_slot_per_step_and_capacity_stays_with_the_displaced():
    clock = Clock()
    sched = scheduler(2, POLICY, clock)
    d0, d1 = fill_with_decodes(sched, clock, 2)
    sched.blocks.reserve("d1", 3)  # its decode growth, as a grant would have reserved it
    held_by_d1 = len(d1.block_table) + 3
    p1, p2 = (Sequence(f"p{i}", (1, 2, 3, 4, 5, 6), GREEDY, seed=0, arrival=10 + i) for i in range(2))
    sched.add(p1)
    sched.add(p2)
    plan = sched.schedule()
    assert plan.preempted == [d1]  # the younger decode, and only one per step
    assert [s for s, _ in plan.prefill] == [p1] and plan.decode == [d0]
    assert list(sched.waiting) == [d1, p2]  # right behind the prompt that displaced it
    assert sched.blocks.reserved["d1"] == held_by_d1  # its blocks come back to it as a reservation
    assert sched.num_priority_preemptions == 1 and d1.num_preemptions == 1
    sched.blocks.check_integrity([s.block_table for s in sched.running])


def test_off_by_default_and_aged_decodes_keep_their_slots():
    clock = Clock()
    off = scheduler(2, None, clock)
    fill_with_decodes(off, clock, 2)
    off.add(Sequence("p", (1, 2, 3), GREEDY, seed=0, arrival=9))
    assert not off.schedule().preempted
    clock = Clock()
    on = scheduler(2, POLICY, clock)
    fill_with_decodes(on, clock, 2)
    clock.now_s += 1.0  # both decodes are now older than the override
    on.add(Sequence("p", (1, 2, 3), GREEDY, seed=0, arrival=9))
    assert not on.schedule().preempted and on.num_priority_preemptions == 0


def test_the_displaced_request_yields_the_same_tokens(gqa_ckpt, engine_factory):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (21, 37, 18)]
    alone = [engine_factory(gqa_ckpt).generate([p], GREEDY)[0].output_ids for p in prompts]
    eng = engine_factory(gqa_ckpt, max_num_seqs=2, prompt_priority=PromptPriority(age_override_ms=1e9))
    eng.add_request("a", prompts[0], GREEDY)
    eng.add_request("b", prompts[1], GREEDY)
    final = {}
    for _ in range(3):  # both prompts prefilled, both decoding
        final.update({o.request_id: o for o in eng.step() if o.finished})
    eng.add_request("c", prompts[2], GREEDY)
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_priority_preemptions == 1
    assert [final[r].output_ids for r in "abc"] == alone


@pytest.mark.parametrize("bad", [dict(age_override_ms=-1), dict(max_preemptions=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="prompt priority"):
        PromptPriority(**bad)
