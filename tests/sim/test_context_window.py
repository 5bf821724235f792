"""The planner's workload is conditioned on the model's context window (prompt + output <= C)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.lengths import parse_length_spec
from pdserve.bench.workload import WorkloadConfig
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hf_geometry import geometry_of
from pdserve.sim.requests import build_requests

SHAREGPT_LIKE = WorkloadConfig(num_requests=400, input_len=parse_length_spec("lognormal:6.3,0.8"),
                               output_len=parse_length_spec("lognormal:5.2,0.8"), seed=0)


def test_context_window_comes_from_the_config():
    assert load_model_spec("opt-13b").max_context == 2048
    assert load_model_spec("llama-70b-class").max_context == 4096
    bare = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    assert geometry_of(bare, "x").max_context is None
    assert geometry_of({**bare, "n_positions": 1024}, "x").max_context == 1024


def test_requests_past_the_window_are_redrawn_and_arrivals_kept():
    free = build_requests(SHAREGPT_LIKE)
    over = sum(p + o > 2048 for p, o in zip(free.prompt_tokens, free.output_tokens))
    assert over > 10  # the lognormal tail passes OPT's 2048 positions
    fit = build_requests(SHAREGPT_LIKE, max_context=2048)
    assert len(fit) == len(free) and fit.unit_arrivals_s == free.unit_arrivals_s
    assert all(p + o <= 2048 for p, o in zip(fit.prompt_tokens, fit.output_tokens))
    # the first requests that fitted keep their lengths, in order (the same seeded draws)
    kept = [(p, o) for p, o in zip(free.prompt_tokens, free.output_tokens) if p + o <= 2048]
    assert list(zip(fit.prompt_tokens, fit.output_tokens))[:50] == kept[:50]
    assert build_requests(SHAREGPT_LIKE, max_context=2048) == fit
    # a window nothing passes is unchanged
    assert build_requests(SHAREGPT_LIKE, max_context=10**6) == free


def test_a_trace_past_the_window_is_refused(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": p, "output_len": 100}) for p in (500, 3000, 700)) + "\n")
    config = WorkloadConfig(num_requests=0, trace_path=str(trace))
    with pytest.raises(ValueError, match="1 of the trace's requests exceed the model's context window of 2048"):
        build_requests(config, max_context=2048)
    assert len(build_requests(config, max_context=4096)) == 3
