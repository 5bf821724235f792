"""`pdserve plan --decode-token-cap N --prefill-batch N`: DistServe's search rules as plan options
(issue 24; docs/planner.md, DistServe). Both reach the phase search and the end-to-end
simulation of the chosen deployment alike; bad values are refused with the flag's name."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.commands.plan import plan_inputs
from pdserve.search.candidates import DecodeTokenCap, Parallel
from pdserve.search.planner import _space, deployment
from pdserve.search.plans import DisaggPlan
from pdserve.search.phase_search import Score
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.requests import build_requests

BASE = ["plan", "--model", "opt-13b", "--hardware", "a100-80g", "--gpus", "8", "--input-len", "512",
        "--output-len", "64", "--num-requests", "20", "--slo-ttft-ms", "250", "--slo-tpot-ms", "100"]


def _inputs(*extra: str):
    return plan_inputs(build_parser().parse_args(BASE + list(extra)))


def _disagg_plan() -> DisaggPlan:
    score = lambda phase, tp: Score(phase, Parallel(tp, 1), 1.0, 1.0, "simulated")  # noqa: E731
    return DisaggPlan("high", score("prefill", 2), score("decode", 1), 1, 1, 1e6, 1e9, 26_000_000_000)


def test_the_defaults_keep_pdserve_s_rules():
    inputs = _inputs()
    assert (inputs.decode_token_cap, inputs.prefill_max_batch) == (None, 1)
    requests = build_requests(inputs.workload)
    space = _space(inputs, requests, requests)
    assert space.decode_token_cap is None and space.prefill_policy == PrefillPolicy()
    config, _pm, dm = deployment(inputs, _disagg_plan())
    assert config.prefill == PrefillPolicy() and not isinstance(dm, DecodeTokenCap)


def test_distserve_s_rules_reach_the_search_and_the_deployment():
    inputs = _inputs("--decode-token-cap", "50000", "--prefill-batch", "1000000", "--pd-decision", "always")
    requests = build_requests(inputs.workload)
    space = _space(inputs, requests, requests)
    assert space.decode_token_cap == 50_000 and space.prefill_policy == PrefillPolicy(max_batch=1_000_000)
    config, pm, dm = deployment(inputs, _disagg_plan())
    assert config.prefill.max_batch == 1_000_000
    assert isinstance(dm, DecodeTokenCap) and dm.cap_tokens == 50_000 and not isinstance(pm, DecodeTokenCap)
    # the cap binds below the K/V that fits one TP1 A100 instance of OPT-13B
    assert dm.kv_capacity_tokens == min(dm.inner.kv_capacity_tokens, 50_000) == 50_000
    assert space.decode_latency(Parallel(1, 1)).kv_capacity_tokens == 50_000


@pytest.mark.parametrize("extra, message", [
    (("--decode-token-cap", "0"), "--decode-token-cap must be >= 1"),
    (("--prefill-batch", "0"), "--prefill-batch must be >= 1"),
])
def test_bad_values_name_their_flag(extra, message):
    with pytest.raises(ValueError, match=message):
        _inputs(*extra)


def test_batched_prefill_is_refused_with_margin_routing(profiled_latency_args):
    args = profiled_latency_args + ["--gpus", "2", "--prefill-batch", "4"]
    with pytest.raises(ValueError, match="--pd-decision always only"):
        plan_inputs(build_parser().parse_args(args))
    assert plan_inputs(build_parser().parse_args(args + ["--pd-decision", "always"])).prefill_max_batch == 4
