"""DistServe's chatbot cases (OPT on A100, ShareGPT-like lengths, the paper's SLOs) on the A100
roofline: the verdicts and the TP ordering docs/planner.md reports, from the same fixed inputs
(`pdserve plan ... --margin 0`, seed 0, 400 requests). Deterministic: the simulator and the
workload are seeded; a change to the latency model or the search that moves a verdict must update
the docs table with it."""

from __future__ import annotations

import argparse

import pytest

from pdserve.commands.plan import plan_inputs, register
from pdserve.search.planner import plan

WORKLOAD = ["--hardware", "a100-80g", "--input-dist", "lognormal:6.3,0.8", "--output-dist", "lognormal:5.2,0.8",
            "--margin", "0"]
CASES = {  # model: (GPUs, TTFT ms, TPOT ms), the paper's chatbot SLOs
    "opt-13b": (8, 250, 100),
    "opt-66b": (16, 2500, 150),
    "opt-175b": (32, 4000, 200),
}
# (verdict at margin 0, colocated (tp, pp), prefill (tp, pp), decode (tp, pp))
EXPECTED = {
    "opt-13b": ("disaggregate", (2, 1), (1, 4), (2, 2)),
    "opt-66b": ("disaggregate", (8, 1), (1, 8), (8, 1)),
    "opt-175b": ("colocate", (8, 1), (1, 16), (8, 2)),
}


def _plan(model: str):
    gpus, ttft, tpot = CASES[model]
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", "--model", model, "--gpus", str(gpus), "--slo-ttft-ms", str(ttft),
                              "--slo-tpot-ms", str(tpot), *WORKLOAD])
    return plan(plan_inputs(args))


@pytest.fixture(scope="module")
def results():
    return {model: _plan(model) for model in CASES}


@pytest.mark.parametrize("model", list(CASES))
def test_verdict_and_shapes(results, model):
    result = results[model]
    verdict, colo, prefill, decode = EXPECTED[model]
    assert result.decision == verdict and result.verdict.decided_by == "goodput_per_gpu"
    c, d = result.colocated, result.disaggregated
    assert (c.score.par.tp, c.score.par.pp) == colo
    assert (d.prefill.par.tp, d.prefill.par.pp) == prefill and (d.decode.par.tp, d.decode.par.pp) == decode
    assert (d.goodput_per_gpu > c.goodput_per_gpu) == (verdict == "disaggregate")
    # not DistServe's ordering: the roofline's prefill instances are TP1 with PP, its decode ones wider
    assert d.prefill.par.tp < d.decode.par.tp
    # the default 10% margin colocates all three (the gains are +2%, +9% and negative)
    assert result.verdict.goodput_gain < 0.1
