"""Each branch of the decode-start fallback chain."""

from __future__ import annotations

from pdserve.router.fallback import DecodeStartAction as A
from pdserve.router.fallback import DecodeStartSituation as S
from pdserve.router.fallback import decide_decode_start


def test_visible_kv_is_enqueued():
    assert decide_decode_start(S(True, 0.0, None)).action is A.ENQUEUE


def test_wait_while_the_transfer_can_land_within_the_ttft_budget():
    decision = decide_decode_start(S(False, 0.5, 0.2, visible_at=("d1",), can_recompute=True))
    assert (decision.action, decision.wait_s) == (A.WAIT, 0.5)


def test_reroute_when_waiting_would_blow_the_budget():
    decision = decide_decode_start(S(False, 0.1, 0.2, visible_at=("d1", "d2"), can_recompute=True))
    assert (decision.action, decision.reroute_to) == (A.REROUTE, "d1")


def test_reroute_when_no_transfer_is_in_flight():
    assert decide_decode_start(S(False, 5.0, None, visible_at=("d3",))).action is A.REROUTE


def test_recompute_when_the_kv_is_nowhere_visible():
    assert decide_decode_start(S(False, 0.0, 0.2, can_recompute=True)).action is A.RECOMPUTE


def test_fail_with_kv_not_visible():
    decision = decide_decode_start(S(False, 0.0, None))
    assert (decision.action, decision.reason) == (A.FAIL, "kv_not_visible")


def test_an_exhausted_budget_never_waits():
    assert decide_decode_start(S(False, 0.0, 0.0)).action is A.FAIL
