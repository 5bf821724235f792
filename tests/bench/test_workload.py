"""Workload generation: length specs, arrivals, seeding, prompts, conversations, traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.bench.arrivals import ArrivalSpec, normalise_trace_times, scale_to_rate, unit_arrivals_s
from pdserve.bench.lengths import fixed, parse_length_spec
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig, build_workload


def test_length_specs():
    rng = np.random.default_rng(0)
    assert parse_length_spec("fixed:128").sample(rng, 3).tolist() == [128, 128, 128]
    assert parse_length_spec("64").sample(rng, 1).tolist() == [64]
    u = parse_length_spec("uniform:1000,2000").sample(rng, 2000)
    assert u.min() >= 1000 and u.max() <= 2000
    n = parse_length_spec("normal:512,64").sample(rng, 20000)
    assert abs(n.mean() - 512) < 3 and abs(n.std() - 64) < 3
    ln = parse_length_spec("lognormal:6.2,0.5").sample(rng, 20000)
    assert abs(np.median(ln) - np.exp(6.2)) < 15
    assert parse_length_spec("normal:1,100").sample(rng, 1000).min() >= 1
    assert str(parse_length_spec("uniform:1,2")) == "uniform:1,2"
    for bad in ("poisson:3", "uniform:5", "uniform:9,3", "fixed:0"):
        with pytest.raises(ValueError):
            parse_length_spec(bad)


def test_arrival_processes_have_unit_mean_and_the_right_cv():
    rng = np.random.default_rng(1)
    for spec, cv in ((ArrivalSpec("poisson"), 1.0), (ArrivalSpec("gamma", 3.0), 3.0), (ArrivalSpec("gamma", 0.5), 0.5)):
        gaps = np.diff(unit_arrivals_s(spec, rng, 50001))
        assert abs(gaps.mean() - 1.0) < 0.05
        assert abs(gaps.std() / gaps.mean() - cv) < 0.1 * cv
    constant = unit_arrivals_s(ArrivalSpec("constant"), rng, 4)
    assert scale_to_rate(constant, 2.0).tolist() == [0.0, 0.5, 1.0, 1.5]
    assert scale_to_rate(constant, float("inf")).tolist() == [0.0] * 4


def test_trace_times_normalise_and_replay():
    unit, rate = normalise_trace_times(np.array([10.0, 10.5, 12.0]))
    assert rate == pytest.approx(1.0)
    assert scale_to_rate(unit, rate).tolist() == pytest.approx([0.0, 0.5, 2.0])


def config(**kw):
    base = dict(num_requests=50, input_len=parse_length_spec("uniform:10,40"), output_len=parse_length_spec("uniform:1,9"), seed=7)
    base.update(kw)
    return WorkloadConfig(**base)


def test_same_seed_same_requests_and_arrivals():
    a, b = build_workload(config()), build_workload(config())
    assert a == b
    assert [r.arrival_s for r in a.at_rate(5.0)] == [r.arrival_s for r in b.at_rate(5.0)]
    c = build_workload(config(seed=8))
    assert [r.arrival_s for r in c.requests] != [r.arrival_s for r in a.requests]


def test_rate_only_rescales_time():
    w = build_workload(config())
    slow, fast = w.at_rate(2.0), w.at_rate(8.0)
    assert [r.prompt for r in slow] == [r.prompt for r in fast]
    assert [4 * f.arrival_s for f in fast] == pytest.approx([s.arrival_s for s in slow])


def test_text_prompt_lengths_assume_byte_tokenizer_with_bos():
    w = build_workload(config(input_len=fixed(100)))
    for r in w.requests:
        assert r.prompt_tokens == 100
        assert len(r.prompt.encode()) + 1 == 100
        assert r.prompt == r.prompt.lower() and r.prompt.isascii()
    wide = build_workload(config(input_len=fixed(100), prompt_style=PromptStyle(bytes_per_token=4.0)))
    assert all(len(r.prompt) == 99 * 4 for r in wide.requests)


def test_id_prompts_are_exact():
    w = build_workload(config(input_len=fixed(33), prompt_style=PromptStyle(format="ids")))
    assert all(len(r.prompt) == 33 and r.prompt_tokens == 33 for r in w.requests)
    assert all(97 <= i < 123 for r in w.requests for i in r.prompt)


def test_multi_turn_prompts_extend_previous_turns_and_share_the_prefix():
    w = build_workload(config(num_conversations=3, shared_prefix_len=20))
    by_conv = {}
    for r in w.requests:
        assert r.conversation_id == r.request_id % 3 and r.turn == r.request_id // 3
        by_conv.setdefault(r.conversation_id, []).append(r)
    prefix = w.requests[0].prompt[:19]
    for turns in by_conv.values():
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt.startswith(earlier.prompt)
            assert len(later.prompt) == len(earlier.prompt) + earlier.output_tokens + (later.prompt_tokens - earlier.prompt_tokens - earlier.output_tokens)
        assert all(t.prompt.startswith(prefix) for t in turns)
    assert [m["role"] for m in w.requests[3].chat_messages()] == ["system", "user", "assistant", "user"]


def test_trace_workload(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"prompt": "hello world", "output_len": 3, "arrival_s": 100.0},
        {"prompt_len": 16, "output_len": 5, "arrival_s": 100.5},
        {"input_len": 8, "output_tokens": 2, "arrival_s": 102.0},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n# comment\n")
    w = build_workload(WorkloadConfig(num_requests=0, trace_path=str(path), arrival=ArrivalSpec("trace")))
    replay = w.at_rate(None)
    assert [r.arrival_s for r in replay] == pytest.approx([0.0, 0.5, 2.0])
    assert replay[0].prompt == "hello world" and replay[0].prompt_tokens == 12
    assert [r.output_tokens for r in replay] == [3, 5, 2]
    assert replay[1].prompt_tokens == 16 and len(replay[1].prompt) == 15
    poisson = build_workload(WorkloadConfig(num_requests=2, trace_path=str(path)))
    assert len(poisson.requests) == 2


def test_bad_trace_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 4, "output_len": 2}\n{"output_len": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        build_workload(WorkloadConfig(num_requests=0, trace_path=str(path)))
