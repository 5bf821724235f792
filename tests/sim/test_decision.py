"""One decision rule: the verdict, the deciding test and the net-margin sign agree (issue 24, part 6)."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.ledger.margin import MarginTerms
from pdserve.search.decision import decide


def _terms(saved_s: float, exposed_s: float = 0.0) -> MarginTerms:
    return MarginTerms(saved_s, exposed_s, 0.0, 0.0)


def test_positive_margin_beside_colocate_is_explained_as_latency_not_capacity():
    # the report: +689.5 ms/request beside COLOCATE; now the deciding test and dT's meaning are named
    v = decide(colo_per_gpu=10.0, disagg_per_gpu=10.5, disagg_feasible=True, margin=0.1, terms=_terms(0.6895))
    assert (v.decision, v.decided_by) == ("colocate", "goodput_per_gpu")
    assert v.delta_t_s == pytest.approx(0.6895) and v.goodput_gain == pytest.approx(0.05)
    assert v.agrees is False
    text = v.explain(0.1)
    assert "+5.0% vs colocated, disaggregate only above +10%" in text
    assert "dT +689.5 ms/request: at matched load a request finishes sooner disaggregated" in text
    assert "it does not decide" in text


def test_goodput_per_gpu_decides_and_dt_is_reported():
    win = decide(10.0, 12.0, True, 0.1, _terms(0.2))
    assert (win.decision, win.decided_by, win.agrees) == ("disaggregate", "goodput_per_gpu", True)
    assert "dT" not in win.explain(0.1)  # dT agrees: nothing to reconcile
    slower = decide(10.0, 12.0, True, 0.1, _terms(0.05, exposed_s=0.1))  # dT = -0.05 s
    assert (slower.decision, slower.agrees) == ("disaggregate", False)
    assert "finishes sooner colocated" in slower.explain(0.1)
    assert decide(10.0, 10.9, True, 0.1, _terms(0.2)).decision == "colocate"  # +9% is not above 10%
    assert decide(10.0, 10.9, True, 0.1, None).agrees is None


def test_infeasible_or_missing_plans():
    assert decide(10.0, 50.0, False, 0.1, _terms(1.0)).decided_by == "kv_link"
    assert decide(10.0, 0.0, True, 0.1, None).decided_by == "kv_link"
    alone = decide(None, 5.0, True, 0.1, None)
    assert (alone.decision, alone.decided_by) == ("disaggregate", "no_colocated_plan")


@pytest.mark.parametrize("prefill_ms,decode_ms,ttft_ms,tpot_ms", [(20, 10, 200, 15), (10, 2, 500, 100)])
def test_plan_report_holds_sign_and_decision_together(tmp_path, capsys, prefill_ms, decode_ms, ttft_ms, tpot_ms):
    model = tmp_path / "const.json"
    model.write_text(json.dumps({"kind": "constant", "prefill_ms": prefill_ms, "decode_step_ms": decode_ms}))
    argv = ["plan", "--model", "tiny", "--latency-model", str(model), "--gpus", "3", "--input-len", "512",
            "--output-len", "64", "--num-requests", "200", "--slo-ttft-ms", str(ttft_ms), "--slo-tpot-ms", str(tpot_ms),
            "--quiet", "--json"]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    dt = s["net_margin"]["delta_t_s"]
    counted = s["verdict_per_gpu"]  # per GPU of the budget: 3, whatever each plan deploys
    assert counted["colocated"]["gpus_counted"] == counted["disaggregated"]["gpus_counted"] == 3
    gain = counted["disaggregated"]["goodput_per_gpu"] / counted["colocated"]["goodput_per_gpu"] - 1
    assert s["decided_by"] == "goodput_per_gpu" and s["goodput_per_gpu_gain"] == pytest.approx(gain)
    assert (s["tie_terms"] is not None) == (abs(gain) <= s["tie_band"])
    assert (s["decision"] == "disaggregate") == (gain > s["decision_margin"])
    assert s["net_margin_agrees"] == ((dt > 0) == (s["decision"] == "disaggregate"))
    if not s["net_margin_agrees"]:
        assert "it does not decide" in s["decision_reason"]
    # (20, 10): capacity favours disaggregation; (10, 2): it does not
    assert s["decision"] == {20: "disaggregate", 10: "colocate"}[prefill_ms]


def test_plan_counts_a_cached_shared_prefix_when_asked():
    from pdserve.cli import build_parser
    from pdserve.commands.plan import plan_inputs
    from pdserve.search.planner import bench_sample

    argv = ["plan", "--model", "llama-13b-class", "--gpus", "1", "--input-len", "1024", "--output-len", "16",
            "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--shared-prefix-len", "256"]
    plain = plan_inputs(build_parser().parse_args(argv))
    cached = plan_inputs(build_parser().parse_args([*argv, "--prefix-cache"]))
    assert not plain.prefix_cache and cached.prefix_cache
    assert set(bench_sample(plain, 8).cached_tokens) == {0}
    sample = bench_sample(cached, 8)
    assert set(sample.cached_tokens) == {256} and set(sample.prompt_tokens) == {1024 + 256}  # a warm system prefix
