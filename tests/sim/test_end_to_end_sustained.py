"""A planned deployment's end-to-end figure is held to the rate it sustains (`planner.EndToEnd`,
`end_to_end_cap`, issue 40), as each instance's score is: the end-to-end run is finite, and a
finite run passes an overloaded deployment where its queue's wait spreads over every output token
inside a loose TPOT. Constant latency models, so every capacity is exact."""

from __future__ import annotations

import pytest

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.lengths import fixed
from pdserve.bench.metrics import Slo
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig
from pdserve.cli import build_parser
from pdserve.commands.plan import plan_inputs
from pdserve.latency.base import ConstantLatency
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import load_hardware
from pdserve.search.candidates import Parallel
from pdserve.search.phase_search import Score
from pdserve.search.plan_report import plan_summary, plan_table
from pdserve.search.planner import PlanInputs, end_to_end_cap, plan
from pdserve.search.plans import ColocatedPlan, DisaggPlan


def test_the_end_to_end_figure_is_held_to_the_decode_pools_sustained_rate():
    # 1P + 1D on 2 GPUs. Decode: 4 sequences a 10 ms step, 10 steps a request: 40 rps sustained (the
    # plan's figure); prefill 1 ms: 1,000 rps. At 60 rps, 2,048 requests leave a backlog that a 5 s
    # TPOT spread over 10 tokens still passes: the finite run's search ends at 2,164 rps.
    workload = WorkloadConfig(num_requests=2048, input_len=fixed(64), output_len=fixed(11), seed=1,
                              arrival=ArrivalSpec("poisson"), prompt_style=PromptStyle(format="ids"))
    inputs = PlanInputs(load_model_spec("opt-13b"), load_hardware("a100-80g"), 2, workload, Slo(ttft_s=1.0, tpot_s=5.0),
                        max_seqs=4, fixed_model=ConstantLatency(prefill_ms=1, decode_step_ms=10), chunk_budgets=(256,))
    result = plan(inputs)
    dis = result.disaggregated
    assert (dis.n_prefill, dis.n_decode) == (1, 1)
    assert (dis.prefill.bound_rps, dis.decode.bound_rps) == pytest.approx((1000.0, 40.0))
    assert dis.goodput_rps == dis.sustained_rps == pytest.approx(40.0)
    e2e = result.end_to_end["disaggregated"]
    assert e2e.search.rate == pytest.approx(2164.21875)  # the finite run alone
    assert e2e.held and e2e.sustained_rps == pytest.approx(40.0) and e2e.rate == pytest.approx(40.0)
    # the colocated figure is not held (its capacity is an estimate): here its run stays below it anyway
    colo = result.end_to_end["colocated"]
    assert colo.sustained_rps is None and not colo.held and colo.rate == colo.search.rate
    summary = plan_summary(result)["disaggregated"]
    assert (summary["simulated_goodput_rps"], summary["simulated_run_rps"], summary["sustained_rps"]) == pytest.approx(
        (40.0, 2164.21875, 40.0))
    assert "the finite run passed 2.16e+03 rps; sim rps is held to the 40 rps the deployment sustains" in plan_table(
        plan_summary(result))


def _disagg(n_prefill: int, n_decode: int) -> DisaggPlan:
    prefill = Score("prefill", Parallel(1, 1), 8.0, 10.0, "simulated")
    decode = Score("decode", Parallel(1, 1), 20.0, 25.0, "simulated")
    return DisaggPlan("high", prefill, decode, n_prefill, n_decode, 1e6, 1e9, 26_000_000_000)


def test_the_cap_is_both_pools_handing_off_and_the_decode_pool_routed_by_margin(profiled_latency_args):
    args = profiled_latency_args + ["--gpus", "4"]
    margin = plan_inputs(build_parser().parse_args(args))
    always = plan_inputs(build_parser().parse_args(args + ["--pd-decision", "always"]))
    assert (margin.pd_modelled, always.pd_modelled) == ("margin", "always")
    plan_ = _disagg(1, 3)  # prefill pool 10 rps, decode pool 75 rps (sustained; scores 8 and 60)
    assert end_to_end_cap(always, plan_) == pytest.approx(10.0)
    # a request prefilled on its decode worker skips the prefill pool: only the decode pool bounds
    assert end_to_end_cap(margin, plan_) == pytest.approx(75.0)
    assert end_to_end_cap(margin, _disagg(3, 1)) == end_to_end_cap(always, _disagg(3, 1)) == pytest.approx(25.0)
    colocated = ColocatedPlan(Score("colocated", Parallel(1, 1), 5.0, 6.0, "simulated", 256), 4, 26_000_000_000)
    assert end_to_end_cap(always, colocated) is None and end_to_end_cap(margin, colocated) is None
