"""Issue 40, live: one case of the sweep with both systems run for real (aiconfigurator's own search,
`cli_default`, and `pdserve plan --latency-model aic:...`), held to the committed sweep and to the
agreement bounds docs/planner_agreement.md states for the whole grid.

One case, not the grid: aiconfigurator's search alone costs 7-14 s of CPU per case here, so one
case keeps the test near 20 s. pdserve searches only the chunk budget its full search picks for the
colocated plan (1024): every candidate's goodput search is independent of the others, so the plan
is the full search's (same numbers; tests/sim/test_distserve_cases.py does the same)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASE = "Q8-h200-8g-chat-tight"  # Qwen3-8B, 8 x H200, 500/200 tokens, TTFT 300 ms, TPOT 15 ms

needs_aic = pytest.mark.skipif(importlib.util.find_spec("aiconfigurator") is None,
                               reason="aiconfigurator is not installed (pip install 'pdserve[aic]')")


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("aic_sweep", ROOT / "scripts" / "aic_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["aic_sweep"] = module
    spec.loader.exec_module(module)
    return module


@needs_aic
@pytest.mark.timeout(300)
def test_one_case_live_matches_the_committed_sweep_and_its_bounds(sweep):
    case = {c.name: c for c in sweep.grid()}[CASE]
    r = sweep.row(case, sweep.run_aic(case), sweep.run_pdserve(case, ("--chunk-budgets", "1024")))
    committed = {x["case"]: x for x in csv.DictReader((ROOT / "docs/figures/aic_sweep.csv").open())}[CASE]
    # both systems answer what the committed CSV says (aiconfigurator's database and pdserve's search unchanged)
    for key in ("aic_agg", "aic_disagg", "pd_colo", "pd_disagg", "pd_decode_instance", "pd_decode_capacity"):
        assert r[key] == pytest.approx(float(committed[key]), rel=1e-6), key
    assert (r["aic_disagg_config"], r["pd_disagg_config"]) == (committed["aic_disagg_config"], committed["pd_disagg_config"])
    # the grid's stated bounds: colocated within 20% of aiconfigurator's aggregated figure; disaggregated
    # above aiconfigurator's (its rate matching applies 0.9 / 0.92 and x1.1 / x1.08 latency corrections
    # that pdserve does not) by less than +40%, and within 5% of it once those four apply to pdserve's
    # capacities; here both colocate, aiconfigurator by more than 10%
    assert abs(r["colo_vs_aic"] - 1) <= sweep.WITHIN
    assert 1.0 < r["disagg_vs_aic"] < 1.4 and abs(r["aic_factors_vs_aic"] - 1) < 0.05
    assert r["aic_ratio"] < 0.9 and (r["aic_verdict"], r["pd_verdict"], r["reading"]) == ("agg", "agg", "agree")
