"""Shared builders for simulator tests."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.lengths import fixed
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig
from pdserve.sim.requests import SimRequests, build_requests


def _make_requests(n: int, prompt: int = 1, output: int = 1, seed: int = 0, arrival: str = "poisson", **kw) -> SimRequests:
    config = WorkloadConfig(num_requests=n, input_len=fixed(prompt), output_len=fixed(output), seed=seed,
                            arrival=ArrivalSpec(arrival), prompt_style=PromptStyle(format="ids"), **kw)
    return build_requests(config)


@pytest.fixture
def make_requests():
    """make_requests(n, prompt, output, seed, arrival, **WorkloadConfig fields) -> SimRequests."""
    return _make_requests


@pytest.fixture
def profiled_latency_args(tmp_path) -> list[str]:
    """`pdserve plan` arguments for a small model priced by a fixed `pdserve profile`-style fit
    (what `--pd-decision margin` models), 64-token prompts, 8 output tokens and loose SLOs; a test
    adds --gpus and its own flags."""
    profile = {"kind": "profiled", "prefill_coef": [0.06, 2.5e-3, 4e-6], "decode_coef": [0.06, 1e-3, 3e-5],
               "kv_bytes_per_token": 12288, "kv_capacity_tokens": 40000}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return ["plan", "--model", "small", "--latency-model", str(path), "--input-len", "64", "--output-len", "8",
            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"]
