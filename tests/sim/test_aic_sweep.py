"""Issue 40: the sweep's arithmetic (scripts/aic_sweep.py), the tie rule, and how the verdict counts GPUs.

The sweep itself runs aiconfigurator and a full `pdserve plan` per case (minutes each on a shared
CPU), so this reduced grid feeds it fixed answers of both systems: the 70B case of the issue
(aiconfigurator 0.12.0 on h100_sxm, and pdserve's plan for it) and a chat case."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.search.candidates import Parallel
from pdserve.search.decision import tie_reading
from pdserve.search.phase_search import Score
from pdserve.search.planner import PlanInputs, counted_gpus
from pdserve.search.plans import DisaggPlan

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "aic_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("aic_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["aic_sweep"] = module
    spec.loader.exec_module(module)
    return module


def test_tie_reading():
    assert tie_reading(1.15, 1.4) == "agree" and tie_reading(0.8, 0.95) == "agree"
    assert tie_reading(1.03, 0.96) == "tie" and tie_reading(0.92, 1.08) == "tie"
    assert tie_reading(1.28, 0.99) == "disagree" and tie_reading(1.05, 0.85) == "disagree"
    assert tie_reading(None, 1.2) == "n/a"


def test_a_budget_counts_every_gpu_a_target_only_the_deployed():
    # the 70B case: 1 prefill TP2 PP5 (10 GPUs) + 1 decode TP4 = 14 of a 16-GPU budget
    pre = Score("prefill", Parallel(2, 5), 9.623, 10.0, "simulated")
    dec = Score("decode", Parallel(4, 1), 9.720, 10.4, "simulated")
    plan = DisaggPlan("high", pre, dec, 1, 1, 1.3e9, 25e9, 141 * 10**9)
    assert plan.gpus == 14 and plan.goodput_per_gpu == pytest.approx(9.623 / 14)
    budget = PlanInputs(model=None, hardware=None, gpus=16, workload=None, slo=None)
    target = PlanInputs(model=None, hardware=None, gpus=16, workload=None, slo=None, target_rps=9.0)
    assert counted_gpus(budget, plan) == 16 and plan.goodput_rps / counted_gpus(budget, plan) == pytest.approx(0.6014, abs=1e-4)
    assert counted_gpus(target, plan) == 14


def test_reduced_grid_rows_summary_csv_and_plot(sweep, tmp_path):
    cases = {c.name: c for c in sweep.grid()}
    assert len(cases) == 32 and {c.system for c in cases.values()} == {"h100_sxm", "h200_sxm"}
    assert {c.gpus for c in cases.values()} == {8, 16, 32} and {(c.isl, c.osl) for c in cases.values()} >= {(500, 200), (8000, 300)}
    chat = cases["L8-h100-8g-chat-tight"]
    aic = {"agg": 27.2, "disagg": 21.1, "agg_config": "tp1pp1 bs64", "disagg_config": "5P tp1pp1 + 3D tp1pp1 bs64"}
    pd = {"colo": 28.9, "disagg": 28.7, "colo_config": "8x tp1pp1 c1024", "disagg_config": "5P tp1pp1 + 3D tp1pp1",
          "decision": "colocate", "tie": None}
    r = sweep.row(chat, aic, pd)
    assert r["aic_verdict"] == "agg" and r["pd_verdict"] == "agg" and r["reading"] == "agree"
    assert r["colo_vs_aic"] == pytest.approx(28.9 / 27.2) and r["disagg_vs_aic"] == pytest.approx(28.7 / 21.1)
    tie = sweep.row(chat, {**aic, "agg": 0.428, "disagg": 0.440}, {**pd, "colo": 0.40, "disagg": 0.38})
    assert tie["reading"] == "tie" and tie["aic_ratio"] == pytest.approx(0.440 / 0.428)
    summary = sweep.summarize([r, tie])
    assert summary["colo"] == {"cases": 2, "within_20pct": 2, "median_signed_error": pytest.approx((28.9 / 27.2 + 0.40 / 0.428) / 2 - 1)}
    assert summary["disagg"]["within_20pct"] == 1 and summary["verdict_agree_where_aic_margin_over_10pct"] == (1, 1)
    sweep.write_csv([r, tie], tmp_path / "s.csv")
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert [x["case"] for x in rows] == [chat.name, chat.name] and float(rows[1]["pd_disagg"]) == 0.38
    svg = sweep._svg([(27.2, 28.9, "colocated"), (0.44, 0.38, "disaggregated")])
    assert svg.startswith("<svg") and svg.count("<circle") == 2


def test_phase_columns_flag_a_decode_above_its_capacity(sweep):
    # L8-h200-8g-chat-loose as both systems answered it: the same 5P TP1 + 3D TP1 shapes, aiconfigurator's
    # workers at its corrected latencies, pdserve's decode instance simulated at 1.62x its capacity (256 seqs)
    case = {c.name: c for c in sweep.grid()}["L8-h200-8g-chat-loose"]
    aic = {"agg": 52.80, "disagg": 38.22, "agg_config": "tp1pp1 bs416", "disagg_config": "5P tp1pp1 + 3D tp1pp1 bs512",
           "prefill_worker_rps": 76.15, "decode_worker_rps": 110.788}
    pd = {"colo": 54.42, "disagg": 55.29, "colo_config": "8x tp1pp1 c1024", "disagg_config": "5P tp1pp1 + 3D tp1pp1",
          "decision": "disaggregate", "tie": None, "n_prefill": 5, "n_decode": 3, "prefill_rps": 88.47,
          "prefill_capacity_rps": 83.76, "decode_rps": 174.61, "decode_capacity_rps": 107.45}
    r = sweep.row(case, aic, pd)
    assert (r["aic_prefill_worker"], r["aic_decode_worker"]) == (76.15, 110.788)
    assert (r["pd_decode_instance"], r["pd_decode_capacity"]) == (174.61, 107.45) and r["reading"] == "disagree"
    # re-counted: each phase at its capacity, the decode pool binds (3 x 107.45 of 8 GPUs), +5% over aic's
    # 38.22; with aiconfigurator's 0.9/1.1 and 0.92/1.08 as well, 3 x 107.45 x 0.852 / 8, 10% below it
    assert r["at_capacity_vs_aic"] == pytest.approx(3 * 107.45 / 8 / 38.22)
    assert r["aic_factors_vs_aic"] == pytest.approx(3 * 107.45 * 0.92 / 1.08 / 8 / 38.22)
    # with each phase's capacity under aiconfigurator's latency corrections (the decode's TPOT batch at a
    # step x1.08): the rate matching's 0.9 and 0.92 apply to those
    corrected = sweep.row(case, aic, {**pd, "prefill_aic_latency_rps": 76.15, "decode_aic_latency_rps": 95.0})
    assert corrected["aic_factors_vs_aic"] == pytest.approx(min(5 * 76.15 * 0.9, 3 * 95.0 * 0.92) / 8 / 38.22)
    assert corrected["pd_decode_aic_latency"] == 95.0
    # so counted, pdserve's disagg/colocated ratio (40.3 / 54.4) sides with aiconfigurator's 0.72: colocate
    assert (r["at_capacity_reading"], r["aic_factors_reading"]) == ("agree", "agree")
    within = sweep.row(case, aic, {**pd, "decode_rps": 107.0})
    old = sweep.row(case, {k: v for k, v in aic.items() if "worker" not in k}, {k: v for k, v in pd.items() if "rps" not in k})
    assert old["pd_decode_capacity"] is None and old["aic_decode_worker"] is None  # a cached answer without them
    assert old["at_capacity_vs_aic"] is None
    summary = sweep.summarize([r, within, old])
    assert summary["pd_decode_above_capacity_by_5pct"] == [case.name]
    assert summary["disagg_at_capacity_vs_aic"]["cases"] == 2
    assert summary["readings"]["disagree"] == 3 and summary["readings_at_capacity"] == {"agree": 2, "tie": 0, "disagree": 0}
    both = (r["aic_factors_vs_aic"] + within["aic_factors_vs_aic"]) / 2 - 1  # the decode pool binds: 3 x 107.45, 3 x 107.0
    assert summary["disagg_aic_factors_vs_aic"]["median_signed_error"] == pytest.approx(both)
