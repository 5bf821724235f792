"""What a decode worker does when a request's K/V is not visible at decode start (section 0x10).

The chain, first applicable wins:

    K/V visible here                           -> ENQUEUE
    a transfer is in flight and should publish
      within what is left of the TTFT budget   -> WAIT (until the budget deadline, then decide again)
    the K/V is visible on another decode worker -> REROUTE there (first candidate: callers order them)
    this worker can re-run the prompt itself   -> RECOMPUTE (correct, though it may miss TTFT)
    otherwise                                  -> FAIL with reason "kv_not_visible"

Only a published K/V counts as visible; a partly received one never does (handoff's job). The
TTFT budget a WAIT may use counts from the prefill's end (router/process/recovery.py), not from
arrival: time a request spent queued, in admission or at its prefill worker, is not held
against its K/V once the prefill work is spent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

KV_NOT_VISIBLE = "kv_not_visible"


class DecodeStartAction(str, enum.Enum):
    ENQUEUE = "enqueue"
    WAIT = "wait"
    REROUTE = "reroute"
    RECOMPUTE = "recompute"
    FAIL = "fail"


@dataclass(frozen=True)
class DecodeStartSituation:
    kv_visible: bool
    ttft_budget_left_s: float
    kv_expected_in_s: float | None  # estimated time to publication; None: no transfer in flight
    visible_at: tuple[str, ...] = ()  # other decode workers with capacity that see the K/V, best first
    can_recompute: bool = False  # this worker has the blocks and the prompt to prefill it itself


@dataclass(frozen=True)
class DecodeStartDecision:
    action: DecodeStartAction
    wait_s: float = 0.0  # WAIT: how long at most before deciding again
    reroute_to: str | None = None  # REROUTE: the decode worker to move the request to
    reason: str = ""  # FAIL: why


def decide_decode_start(situation: DecodeStartSituation) -> DecodeStartDecision:
    s = situation
    if s.kv_visible:
        return DecodeStartDecision(DecodeStartAction.ENQUEUE)
    if _can_wait(s):
        return DecodeStartDecision(DecodeStartAction.WAIT, wait_s=s.ttft_budget_left_s)
    if s.visible_at:
        return DecodeStartDecision(DecodeStartAction.REROUTE, reroute_to=s.visible_at[0])
    if s.can_recompute:
        return DecodeStartDecision(DecodeStartAction.RECOMPUTE)
    return DecodeStartDecision(DecodeStartAction.FAIL, reason=KV_NOT_VISIBLE)


def _can_wait(s: DecodeStartSituation) -> bool:
    return s.kv_expected_in_s is not None and 0.0 < s.ttft_budget_left_s and s.kv_expected_in_s <= s.ttft_budget_left_s
