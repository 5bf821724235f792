"""Shared builders for simulator tests."""

from __future__ import annotations

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
