"""Each branch of the decode-start fallback chain, and the whole chain against the spec's pseudo-code."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.router.process.fallback import DecodeStartAction as A
from pdserve.router.process.fallback import DecodeStartSituation as S
from pdserve.router.process.fallback import decide_decode_start


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


def spec_start_decode(s: S) -> tuple[A, str | None]:
    """The spec's start_decode (section 0x10), transcribed branch for branch."""
    if s.kv_visible:
        return A.ENQUEUE, None
    can_wait_within_ttft = s.kv_expected_in_s is not None and s.ttft_budget_left_s > 0 and s.kv_expected_in_s <= s.ttft_budget_left_s
    if can_wait_within_ttft:
        return A.WAIT, None
    if len(s.visible_at) > 0:
        return A.REROUTE, s.visible_at[0]
    if s.can_recompute:
        return A.RECOMPUTE, None
    return A.FAIL, None


situations = st.builds(
    S,
    kv_visible=st.booleans(),
    ttft_budget_left_s=st.floats(-5.0, 5.0),
    kv_expected_in_s=st.none() | st.floats(0.0, 5.0),
    visible_at=st.lists(st.sampled_from(["d0", "d1", "d2"]), max_size=3, unique=True).map(tuple),
    can_recompute=st.booleans(),
)


@given(situations)
def test_the_decision_is_the_spec_chain(s):
    decision = decide_decode_start(s)
    action, target = spec_start_decode(s)
    assert decision.action is action
    assert decision.reroute_to == target
    assert (decision.reason == "kv_not_visible") == (action is A.FAIL)
    if action is A.WAIT:
        assert 0 < decision.wait_s == s.ttft_budget_left_s
