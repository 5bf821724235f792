"""Splitwise's pool controller (router/splitwise/splitwise.py): hysteresis, cooldown, a worker left in each
pool, the least loaded worker lent (the mixed state: it keeps its role), a loan returned or adopted."""

from __future__ import annotations

import pytest

from pdserve.router.splitwise.splitwise import Move, PoolController, PoolSignals, Thresholds

T = Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=3, cooldown_s=10.0)
PROMPT_PRESSED = PoolSignals({"p0": 3.0, "p1": 2.5}, {"d0": 0.2, "d1": 0.1, "d2": 0.3})
TOKEN_PRESSED = PoolSignals({"p0": 0.1, "p1": 0.0}, {"d0": 0.9, "d1": 0.7})
CALM = PoolSignals({"p0": 1.0, "p1": 1.0}, {"d0": 0.6, "d1": 0.6})


def test_a_lasting_prompt_backlog_moves_the_least_loaded_decode_worker():
    c = PoolController(T)
    assert [c.observe(PROMPT_PRESSED, t) for t in (0.0, 1.0)] == [None, None]  # not lasting yet
    move = c.observe(PROMPT_PRESSED, 2.0)
    assert move == Move("d1", "prefill", move.reason) and "prompt queue 2.75s" in move.reason


def test_a_lasting_token_pressure_moves_the_idlest_prefill_worker():
    c = PoolController(T)
    moves = [c.observe(TOKEN_PRESSED, float(t)) for t in range(3)]
    assert moves[:2] == [None, None] and (moves[2].worker_id, moves[2].to_role) == ("p1", "decode")


def test_a_calm_observation_resets_the_streak_and_a_move_starts_a_cooldown():
    c = PoolController(T)
    heavy = PoolSignals({"p0": 4.0, "p1": 3.5}, {"d0": 0.2, "d1": 0.1, "d2": 0.3})  # pressed even with d1 lent
    for t, signals in enumerate([heavy, heavy, CALM, heavy, heavy]):
        assert c.observe(signals, float(t)) is None  # the calm one broke the streak
    assert c.observe(heavy, 5.0) == Move("d1", "prefill", c.moves[0].reason)
    assert all(c.observe(heavy, 5.0 + dt) is None for dt in (1.0, 2.0, 3.0, 9.9))  # cooling down
    # 7.5 s over three prompt-pool workers (d1 lent there) is still 2.5 s each: the next idlest goes too
    assert c.observe(heavy, 15.1) == Move("d0", "prefill", c.moves[1].reason) and len(c.moves) == 2


def test_pressure_on_both_pools_moves_nothing_and_each_pool_keeps_a_worker():
    c = PoolController(T)
    both = PoolSignals({"p0": 5.0}, {"d0": 0.95})
    assert all(c.observe(both, float(t)) is None for t in range(6))
    alone = PoolSignals({"p0": 5.0}, {"d0": 0.1})  # pressed prompt pool, but a single decode worker
    assert all(c.observe(alone, float(t)) is None for t in range(6))


def test_marks_must_be_ordered():
    with pytest.raises(ValueError):
        Thresholds(prompt_high_s=1.0, prompt_low_s=2.0)
    with pytest.raises(ValueError):
        Thresholds(kv_high=0.5, kv_low=0.6)


def test_a_loan_goes_back_when_the_borrowing_pool_calms_and_a_lasting_one_is_adopted():
    # the spec's loan: d1 stays a decode worker (its K/V in the token pool's signals) and takes
    # prompt work as well (its queued prompts: local_prompt_s); only adoption changes its role
    marks = Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=2, cooldown_s=1.0,
                       adopt_after_s=30.0)
    c = PoolController(marks)
    assert [c.observe(PROMPT_PRESSED, t) for t in (0.0, 1.0)][1].kind == "lend"
    assert c.loans == {"d1": ("decode", 1.0)}
    calm = PoolSignals({"p0": 0.1, "p1": 0.2}, {"d0": 0.2, "d1": 0.1, "d2": 0.3}, local_prompt_s={"d1": 0.3})
    assert c.observe(calm, 2.0) is None  # calm once: not yet
    back = c.observe(calm, 3.0)
    assert (back.worker_id, back.to_role, back.kind) == ("d1", "decode", "return") and c.loans == {}
    # lent again, and the prompt backlog lasts past adopt_after_s: the loan becomes a role change
    c = PoolController(marks)
    c.observe(PROMPT_PRESSED, 0.0)
    assert c.observe(PROMPT_PRESSED, 1.0).kind == "lend"
    # 5.7 s over three prompt-pool workers: 1.9 s each, never calm (0.5 s) nor pressed for a second loan
    still = PoolSignals({"p0": 3.0, "p1": 2.5}, {"d0": 0.2, "d1": 0.1, "d2": 0.3}, local_prompt_s={"d1": 0.2})
    moves = {t: c.observe(still, float(t)) for t in range(2, 32)}
    assert [(t, m.worker_id, m.to_role, m.kind) for t, m in moves.items() if m is not None] == [(31, "d1", "prefill", "change")]
    assert c.loans == {}  # lent at 1.0, adopted 30 s later: a role change, no longer a loan


def test_a_lent_worker_counts_in_the_prompt_pool_it_serves_and_is_never_lent_twice():
    c = PoolController(Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=1, cooldown_s=0.0))
    assert c.observe(PoolSignals({"p0": 3.0}, {"d0": 0.1, "d1": 0.2}), 0.0) == Move("d0", "prefill", c.moves[0].reason)
    # 4.4 s queued over p0 and the lent d0 is 2.2 s each: still pressed, and d1 (not d0 again) goes
    second = c.observe(PoolSignals({"p0": 3.0}, {"d0": 0.0, "d1": 0.2}, local_prompt_s={"d0": 1.4}), 1.0)
    assert second == Move("d1", "prefill", second.reason) and "2.20s per worker" in second.reason
    assert c.observe(PoolSignals({"p0": 9.0}, {"d0": 0.0, "d1": 0.0}), 2.0) is None  # every decode worker is lent


def test_a_loan_waits_while_its_worker_is_away_and_adoption_keeps_a_worker_in_each_pool():
    marks = Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=1, cooldown_s=0.0,
                       adopt_after_s=5.0)
    c = PoolController(marks)
    assert c.observe(PoolSignals({"p0": 3.0}, {"d0": 0.1, "d1": 0.2}), 0.0).worker_id == "d0"
    away = PoolSignals({"p0": 0.0}, {"d1": 0.2})  # d0 restarts: calm, but it is not LIVE to be returned
    assert c.observe(away, 1.0) is None and "d0" in c.loans
    c.forget("d0")  # it came back unlent (role_control drops a loan the router no longer holds)
    assert c.loans == {}
    # the only other decode worker is lent and its loan lasts: d1 may not leave the token pool for
    # good while it is the last decode worker (d0 away), so the loan stays a loan
    c = PoolController(marks)
    c.observe(PoolSignals({"p0": 3.0}, {"d0": 0.1, "d1": 0.2}), 0.0)
    pressed = PoolSignals({"p0": 3.0}, {"d0": 0.1}, local_prompt_s={"d0": 2.0})
    assert [c.observe(pressed, float(t)) for t in range(6, 9)] == [None] * 3 and "d0" in c.loans


def test_decode_step_pressure_counts_as_token_pressure():
    c = PoolController(T)
    slow = PoolSignals({"p0": 0.0, "p1": 0.0}, {"d0": 0.1, "d1": 0.1}, tpot_used={"d0": 0.95, "d1": 0.2})
    moves = [c.observe(slow, float(t)) for t in range(3)]
    assert moves[2] is not None and moves[2].to_role == "decode" and "token pool at 95%" in moves[2].reason


def test_the_last_prompt_worker_goes_to_the_token_pool_only_when_decode_workers_prefill():
    lone = PoolSignals({"p0": 0.0}, {"d0": 0.1}, tpot_used={"d0": 0.9})
    fixed = PoolController(T)
    assert all(fixed.observe(lone, float(t)) is None for t in range(6))
    mixed = PoolController(T, prompt_pool_may_empty=True)
    moves = [mixed.observe(lone, float(t)) for t in range(3)]
    assert moves[2] == Move("p0", "decode", moves[2].reason, "lend") and mixed.loans == {"p0": ("prefill", 2.0)}
    # the token pool still keeps its last worker
    backlog = PoolSignals({"p0": 9.0}, {"d0": 0.0})
    assert all(PoolController(T, prompt_pool_may_empty=True).observe(backlog, float(t)) is None for t in range(6))


def test_local_prefill_backlog_on_decode_workers_is_prompt_pressure():
    # decode steps are slow because the decode worker prefills long prompts locally: that is a
    # prompt backlog, so the prompt worker must not be lent away
    busy = PoolSignals({"p0": 0.2}, {"d0": 0.1}, tpot_used={"d0": 1.5}, local_prompt_s={"d0": 4.0})
    c = PoolController(T, prompt_pool_may_empty=True)
    assert all(c.observe(busy, float(t)) is None for t in range(6))
    assert c.prompt_streak == 0  # one prefill worker's 4.2 s, but the decode pool is pressed too


def test_a_pressed_pool_is_met_by_mixed_workers_with_room_before_a_worker_is_borrowed():
    marks = Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=2, cooldown_s=0.0)
    c = PoolController(marks)
    # 3.0 s queued at p0 and 1.0 s at the mixed m0: 4.0 s on the one prefill worker, pressed; m0 has room
    roomy = PoolSignals({"p0": 3.0}, {"d0": 0.1, "d1": 0.2}, local_prompt_s={"m0": 1.0}, mixed_kv_used={"m0": 0.3})
    assert [c.observe(roomy, float(t)) for t in range(4)] == [None] * 4
    assert c.offer.prefill and not c.offer.decode  # m0 offered to the prompt pool at the second observation
    full = PoolSignals({"p0": 3.0}, {"d0": 0.1, "d1": 0.2}, local_prompt_s={"m0": 2.5}, mixed_kv_used={"m0": 0.3})
    moves = [c.observe(full, float(t)) for t in range(4, 6)]
    assert moves[0] is None and moves[1] == Move("d0", "prefill", moves[1].reason)  # m0 full for `hold`: borrow


def test_a_pressed_token_pool_is_met_by_mixed_workers_with_room_first():
    marks = Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=2, cooldown_s=0.0)
    c = PoolController(marks)
    roomy = PoolSignals({"p0": 0.1, "p1": 0.0}, {"d0": 0.9}, tpot_used={"m0": 0.7}, mixed_kv_used={"m0": 0.4})
    assert [c.observe(roomy, float(t)) for t in range(4)] == [None] * 4 and c.offer.decode
    slow = PoolSignals({"p0": 0.1, "p1": 0.0}, {"d0": 0.9}, tpot_used={"m0": 0.85}, mixed_kv_used={"m0": 0.4})
    moves = [c.observe(slow, float(t)) for t in range(4, 6)]  # m0's decodes at 85% of the TPOT objective: no room
    assert moves[0] is None and moves[1] == Move("p1", "decode", moves[1].reason)


def test_a_prefill_worker_lent_to_the_token_pool_counts_in_its_pressure_and_its_room():
    c = PoolController(Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=1, cooldown_s=0.0))
    prompts = {"p0": 0.1, "p1": 0.0, "p2": 0.0}
    first = c.observe(PoolSignals(prompts, {"d0": 0.9}), 0.0)
    assert first == Move("p1", "decode", first.reason) and "token pool at 90%" in first.reason
    # d0 still at 90%, but the lent p1 has room (K/V 40%, TPOT 30%): no second loan
    roomy = PoolSignals(prompts, {"d0": 0.9}, tpot_used={"p1": 0.3}, prefill_kv_used={"p0": 0.2, "p1": 0.4, "p2": 0.1})
    assert c.observe(roomy, 1.0) is None and c.loans == {"p1": ("prefill", 0.0)}
    # d0's decodes ended (30%) while p1 decodes at 70% of the TPOT objective: the pool is at 70%,
    # not calm (50%), so the loan stays (p0's 90% is prompt work: it is not lent)
    busy_guest = PoolSignals(prompts, {"d0": 0.3}, tpot_used={"p1": 0.7}, prefill_kv_used={"p0": 0.9, "p1": 0.6})
    assert c.observe(busy_guest, 2.0) is None and c.loans == {"p1": ("prefill", 0.0)}
    # both over the mark (d0 85%, p1 K/V 82%): no guest has room, the next prefill worker goes
    full = PoolSignals(prompts, {"d0": 0.85}, tpot_used={"p1": 0.5}, prefill_kv_used={"p1": 0.82})
    second = c.observe(full, 3.0)
    assert second == Move("p2", "decode", second.reason) and "token pool at 85%" in second.reason
    calm = PoolSignals(prompts, {"d0": 0.3}, prefill_kv_used={"p1": 0.45, "p2": 0.1})
    back = c.observe(calm, 4.0)  # every member under 50%: the oldest loan returns
    assert (back.worker_id, back.to_role, back.kind) == ("p1", "prefill", "return")
