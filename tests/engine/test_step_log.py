"""The engine step log records each step's shape exactly, and its reader filters by window."""

from __future__ import annotations

import time

import pytest

from pdserve.engine.sequence import SamplingParams
from pdserve.engine.step_log import StepLog, StepRecord, read_steps


def test_each_step_is_recorded_with_its_shape(gqa_ckpt, engine_factory, tmp_path):
    engine = engine_factory(gqa_ckpt, max_num_batched_tokens=16, enable_prefix_cache=False)
    path = tmp_path / "w.steps.jsonl"
    engine.step_log = StepLog(path)
    before = time.time()
    engine.add_request("a", list(range(1, 21)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("b", list(range(30, 35)), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.step_log.close()
    steps = read_steps([path])
    shapes = [(s.new, s.cached, s.batch, s.context) for s in steps]
    # budget 16: a's first chunk; then a's last 4 rows + b's 5 prompt rows; then decodes
    # (a 3 more tokens, b 1 more), context = tokens visible to each decode row, summed
    assert shapes == [((16,), (0,), 0, 0), ((4, 5), (16, 0), 0, 0), ((), (), 2, 21 + 6), ((), (), 1, 22),
                      ((), (), 1, 23)]
    assert [s.kind for s in steps] == ["prefill", "prefill", "decode", "decode", "decode"]
    assert all(s.seconds > 0 and before <= s.end <= time.time() for s in steps)
    assert read_steps([path], steps[2].end, steps[3].end) == steps[2:4]


def test_a_mixed_step_is_one_record():
    assert StepRecord(0.0, 0.1, (8,), (0,), 3, 90).kind == "mixed"


def test_reader_skips_a_torn_last_line_and_refuses_garbage(tmp_path):
    path = tmp_path / "w.steps.jsonl"
    log = StepLog(path)
    log.record(StepRecord(10.0, 0.05, (), (), 2, 40))
    log.close()
    with path.open("ab") as f:
        f.write(b'{"end": 11.0, "seco')  # a writer mid-line
    assert read_steps([path]) == [StepRecord(10.0, 0.05, (), (), 2, 40)]
    path.write_bytes(b'{"end": 1}\nnot json\n')
    with pytest.raises(ValueError, match="not a step record"):
        read_steps([path])
