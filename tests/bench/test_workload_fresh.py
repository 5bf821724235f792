"""A sweep's later rate points get fresh prompt content with the same lengths and arrivals."""

from __future__ import annotations

from dataclasses import replace

from pdserve.bench.app import fresh_content
from pdserve.bench.lengths import fixed
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig, build_workload


def _config(**kw) -> WorkloadConfig:
    return WorkloadConfig(num_requests=12, input_len=fixed(40), output_len=fixed(8), seed=3, **kw)


def test_salt_changes_content_only():
    for style in (PromptStyle(), PromptStyle(format="ids")):
        cfg = _config(prompt_style=style)
        base, salted = build_workload(cfg), build_workload(replace(cfg, content_salt=1))
        assert [r.arrival_s for r in base.requests] == [r.arrival_s for r in salted.requests]
        assert [(r.prompt_tokens, r.output_tokens) for r in base.requests] == \
            [(r.prompt_tokens, r.output_tokens) for r in salted.requests]
        assert all(a.prompt != b.prompt for a, b in zip(base.requests, salted.requests))
        assert build_workload(replace(cfg, content_salt=1)).requests == salted.requests  # still seeded


def test_fresh_content_keeps_the_first_point_and_varies_later_ones():
    cfg = _config()
    first = build_workload(cfg)
    assert fresh_content(cfg, first, 0) is first
    prompts = [tuple(r.prompt for r in fresh_content(cfg, first, k).requests) for k in range(3)]
    assert len(set(prompts)) == 3
    shared = _config(shared_prefix_len=16)  # within a point, the shared prefix is still shared
    point = fresh_content(shared, build_workload(shared), 2)
    heads = {r.prompt[:12] for r in point.requests}
    assert len(heads) == 1
