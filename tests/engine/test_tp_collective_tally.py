"""A TP 2 engine's rank 0 counts every step it runs in its collective tally (engine/tp_group.py,
engine/tp_tally.py): one prefill step of the prompt's rows, one decode step of one row per later
token, each with wall seconds in its all_reduces and broadcast; a TP 1 engine has no tally (its
heartbeat reports none, workers/heartbeat.collective_report)."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.heartbeat import collective_report


def test_rank0_tallies_each_phase_steps_rows_and_seconds():
    engine = Engine(EngineConfig(model="tiny", dtype="float32", num_blocks=64, max_num_batched_tokens=256, tp=2))
    try:
        assert collective_report(engine).prefill.steps == 0  # the window opens empty
        engine.generate([list(range(1, 41))], SamplingParams(max_tokens=6, ignore_eos=True))
        report = collective_report(engine)
        p, d = report.prefill, report.decode
        assert (p.steps, p.rows, p.rows_sq) == (1, 40, 1600)  # the whole prompt in one step
        assert (d.steps, d.rows, d.rows_sq) == (5, 5, 5)  # tokens 2..6, one row each
        assert p.rows_reduce_s == pytest.approx(40 * p.reduce_s) and d.rows_reduce_s == pytest.approx(d.reduce_s)
        for phase in (report.prefill, report.decode):
            assert phase.reduce_s > 0 and phase.broadcast_s > 0
        assert collective_report(engine).decode.steps == 0  # taken once
    finally:
        engine.close()
    single = Engine(EngineConfig(model="tiny", dtype="float32", num_blocks=16))
    assert collective_report(single) is None
