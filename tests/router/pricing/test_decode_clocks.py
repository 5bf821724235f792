"""The decode workers' token clocks the P/D decision reads (router/pricing/decode_clocks.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine.sequence import SamplingParams
from pdserve.ledger.margin import DecodeBudget
from pdserve.router.pricing.decode_clocks import ItlWindows, decode_budgets


def test_p90_of_the_last_window_of_gaps_per_worker():
    itl = ItlWindows(window=10)
    assert itl.p90_s("d0") == 0.0
    for gap in [0.01] * 9 + [0.5]:
        itl.observe("d0", gap)
    assert itl.p90_s("d0") == pytest.approx(0.01 + 0.1 * (0.5 - 0.01), abs=1e-12)  # linear: position 8.1 of 0..9
    for _ in range(10):  # the window slides: the spike is gone
        itl.observe("d0", 0.02)
    assert itl.p90_s("d0") == pytest.approx(0.02, abs=1e-12) and itl.p90_s("d1") == 0.0
    itl.forget("d0")
    assert itl.p90_s("d0") == 0.0


def live(decode_id: str, tokens: int, first_s: float | None, max_tokens: int, done: bool = False):
    req = SimpleNamespace(params=SamplingParams(max_tokens=max_tokens))
    return SimpleNamespace(decode_id=decode_id, output_ids=[7] * tokens, first_token_s=first_s, req=req, done=done)


def test_each_live_decode_s_own_budget():
    lives = [live("d0", 50, 2.0, 52), live("d0", 1, None, 10), live("d1", 5, 1.0, 8), live("d0", 3, 9.0, 3, done=True),
             live("d0", 8, 9.5, 4)]
    assert decode_budgets(lives, "d0", 10.0) == (DecodeBudget(50, 8.0, 2), DecodeBudget(8, 0.5, 0))
