"""One decision rule: the verdict, the deciding test and the net-margin sign agree (issue 24, part 6)."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.ledger.margin import MarginTerms
from pdserve.search.decision import decide


def _terms(saved_s: float, exposed_s: float = 0.0) -> MarginTerms:
    return MarginTerms(saved_s, exposed_s, 0.0, 0.0)


def test_positive_margin_beside_colocate_is_decided_by_goodput_per_gpu():
    # the report: +689.5 ms/request and COLOCATE; now the capacity test is named as the decider
    v = decide(colo_per_gpu=10.0, disagg_per_gpu=10.5, disagg_feasible=True, margin=0.1, terms=_terms(0.6895))
    assert (v.decision, v.decided_by) == ("colocate", "goodput_per_gpu")
    assert v.delta_t_s == pytest.approx(0.6895)
    assert v.goodput_gain == pytest.approx(0.05)
    assert "latency saving, not a capacity one" in v.explain(0.1)


def test_disaggregate_needs_capacity_and_a_positive_margin_and_the_gates():
    assert decide(10.0, 12.0, True, 0.1, _terms(0.2)).decision == "disaggregate"
    assert decide(10.0, 12.0, True, 0.1, _terms(0.2)).decided_by == "all"
    slower = decide(10.0, 12.0, True, 0.1, _terms(0.05, exposed_s=0.1))  # dT = -0.05 s
    assert (slower.decision, slower.decided_by) == ("colocate", "net_margin")
    assert slower.delta_t_s == pytest.approx(-0.05)
    missed_gate = decide(10.0, 12.0, True, 0.1, _terms(0.2), gates=(True, False))
    assert (missed_gate.decision, missed_gate.decided_by) == ("colocate", "net_margin")
    under_margin = decide(10.0, 10.9, True, 0.1, _terms(0.2))  # +9% is not more than 10%
    assert under_margin.decided_by == "goodput_per_gpu"


def test_infeasible_or_missing_plans():
    assert decide(10.0, 50.0, False, 0.1, _terms(1.0)).decided_by == "kv_link"
    assert decide(10.0, 0.0, True, 0.1, None).decided_by == "kv_link"
    assert decide(None, 5.0, True, 0.1, None).decision == "disaggregate"
    assert decide(None, 5.0, True, 0.1, None).decided_by == "no_colocated_plan"


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
    gain = s["disaggregated"]["goodput_per_gpu"] / s["colocated"]["goodput_per_gpu"] - 1
    assert s["goodput_per_gpu_gain"] == pytest.approx(gain)
    if s["decision"] == "disaggregate":
        assert s["decided_by"] == "all" and dt > 0 and gain > s["decision_margin"]
    else:
        assert s["decided_by"] in ("goodput_per_gpu", "net_margin", "kv_link")
        if s["decided_by"] == "goodput_per_gpu":
            assert gain <= s["decision_margin"]
        if s["decided_by"] == "net_margin":
            assert gain > s["decision_margin"]
    # (20, 10): capacity and latency both favour disaggregation; (10, 2): capacity does not
    expected = {20: ("disaggregate", "all"), 10: ("colocate", "goodput_per_gpu")}[prefill_ms]
    assert (s["decision"], s["decided_by"]) == expected
