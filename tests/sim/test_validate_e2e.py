"""`pdserve plan --validate` orchestration end to end: the real runtime (tiny model, fp32) and the benchmark.

One colocated worker, a 2-rate ladder, a handful of short requests. Checks the bench report is
read (joint goodput and the sweep rows) and that the server's whole process group (router and
worker) is gone afterwards. The rates are high enough that a point's arrivals span about a
second (a point's requests arrive by a Poisson clock at its rate): under the loose SLOs every
rate passes on any machine, and a test waits on the server, not on the clock.
"""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest

from pdserve.validate import run as vrun
from pdserve.validate import runtime as v

# SLOs every request meets on any machine (a tiny-model request of 16 + 4 tokens takes well under a
# second even on a loaded 2-core one), so which rates pass does not depend on the machine's speed
LOOSE_SLOS = ("--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000")


def _group_commands(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-e", "-o", "pgid=,comm=,args="], capture_output=True, text=True).stdout
    return [line.split(None, 1)[1] for line in out.splitlines() if line.split() and line.split()[0] == str(pgid)]


def test_ladder_brackets_the_prediction():
    assert v.ladder_around(8.0) == [2.0, 4.0, 8.0, 12.0]
    assert v.ladder_around(0.0) == [0.25, 0.5, 1.0, 1.5]


def test_bracket_decides_a_relative_error_against_the_measurement():
    lo, hi = v.bracket(1.0, 0.15)
    assert (lo, hi) == (0.8696, 1.176)  # pred/(1+T), pred/(1-T) to 4 digits
    # a measured goodput m in [lo, hi) has |pred - m| <= 0.15 m at both ends
    assert abs(1.0 - lo) <= 0.15 * lo + 1e-4 and abs(1.0 - hi) <= 0.15 * hi + 1e-3
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            v.bracket(1.0, bad)
    with pytest.raises(ValueError):
        v.bracket(0.0, 0.15)


def _report(points: dict[float, float]) -> dict:
    return {"slo_attainment": 0.9, "sweep": [{"rate": r, "attainment_joint": a} for r, a in points.items()]}


def test_bracket_verdicts_from_the_bench_sweep():
    rates = [0.87, 1.18]
    assert v.bracket_verdict(rates, _report({0.87: 0.95, 1.18: 0.5}))["measured_vs_prediction"] == "within"
    assert v.bracket_verdict(rates, _report({0.87: 0.95, 1.18: 0.5}))["within_tolerance"] is True
    assert v.bracket_verdict(rates, _report({0.87: 0.85}))["measured_vs_prediction"] == "below"  # sweep stops
    above = v.bracket_verdict(rates, _report({0.87: 1.0, 1.18: 0.9}))  # exactly p passes
    assert above["measured_vs_prediction"] == "above" and above["within_tolerance"] is False
    assert v.bracket_verdict(rates, _report({}))["measured_vs_prediction"] == "unknown"


def test_bracket_ranking_needs_disjoint_intervals():
    from pdserve.search.plan_report import bracket_ranking

    def row(name, lo, hi, where):
        return {"name": name, "bracket_rps": [lo, hi], "within_tolerance": where == "within",
                "measured_vs_prediction": where}

    assert bracket_ranking([row("colocated", 0.1, 0.14, "within"), row("disaggregated", 0.2, 0.3, "within")]) == "disaggregated"
    assert bracket_ranking([row("colocated", 0.1, 0.14, "above"), row("disaggregated", 0.2, 0.3, "within")]) is None
    assert bracket_ranking([row("colocated", 0.1, 0.14, "within"), row("disaggregated", 0.2, 0.3, "below")]) is None
    assert bracket_ranking([row("colocated", 0.3, 0.4, "above"), row("disaggregated", 0.2, 0.3, "within")]) == "colocated"


def test_goodput_keys_of_the_bench_report():
    report = {"request_goodput": 2.0, "request_goodput_phase": 3.0, "sweep": [{"rate": 1.0, "attainment_joint": 1.0}],
              "goodput_search": {"ladder": [1.0, 2.0], "joint": {"rate": 2.0, "saturated": True}}}
    m = vrun._measured(report)
    assert m["measured_goodput_rps"] == 2.0 and m["measured_goodput_phase_rps"] == 3.0
    assert m["measured_saturated"] is True and m["sweep"][0]["rate"] == 1.0


def test_validate_runs_the_tiny_model_and_stops_every_process(monkeypatch):
    seen: dict[str, list[str]] = {}
    stop = v.stop_group

    def recording_stop(proc, *a, **kw):
        seen["before"] = _group_commands(proc.pid)
        stop(proc, *a, **kw)
        seen["after"] = _group_commands(proc.pid)

    monkeypatch.setattr(v, "stop_group", recording_stop)
    config = v.LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=2.0,
                           extra_serve_args=("--dtype", "float32"))
    bench = ["--num-requests", "6", "--input-len", "16", "--output-len", "4", *LOOSE_SLOS,
             "--max-bisections", "0", "--prompt-format", "ids", "--seed", "0"]
    rows = vrun.validate([config], "tiny", bench, rates=[4.0, 8.0])
    row = rows[0]
    assert "error" not in row, row.get("error")
    assert row["measured_goodput_rps"] == 8.0  # loose SLOs: the top of the ladder passes
    assert row["measured_saturated"] is True
    assert [p["rate"] for p in row["sweep"]] == [4.0, 8.0]
    # the server's own process group held the worker, and nothing of it survives the stop
    assert any(c.startswith("pd-colocated-0 ") for c in seen["before"]), seen["before"]  # its name (workers/process/warm_start.py)
    assert seen["after"] == []


def test_validate_calibrates_against_the_server_then_checks_a_bracket(tmp_path):
    """The calibrator runs a burst through the live server before the benchmark; the bracket is
    centred on the prediction it returns; logs and the bench report are kept."""
    from pdserve.validate.calibrate import burst_requests

    seen = {}

    def calibrator(config, url, round_):
        seen["calibration"] = cal = burst_requests(url, (0.01, 0.005), 16, 4, burst=2, repeats=1)
        return {**cal.to_dict(), "goodput_elasticity": 3.0}, 8.0

    config = v.LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=50.0,
                           extra_serve_args=("--dtype", "float32"))
    bench = ["--num-requests", "4", "--input-len", "16", "--output-len", "4", *LOOSE_SLOS,
             "--prompt-format", "ids", "--seed", "0"]
    row = vrun.validate([config], "tiny", bench, tolerance=0.15, calibrator=calibrator, keep_dir=tmp_path)[0]
    assert "error" not in row, row.get("error")
    cal = seen["calibration"]
    assert cal.measured_ttft_s > 0 and cal.measured_tpot_s > 0 and cal.predicted_ttft_s == 0.01
    assert cal.decode_factor == cal.measured_tpot_s / 0.005
    assert row["calibration"]["prefill_factor"] == cal.measured_ttft_s / cal.predicted_ttft_s
    assert row["calibrated_goodput_rps"] == 8.0 and row["bracket_rps"] == [6.957, 9.412]
    assert [p["rate"] for p in row["sweep"]] == [6.957, 9.412]  # the bracket, not the 50 rps estimate
    assert row["measured_vs_prediction"] == "above"  # loose SLOs: both rates pass
    assert row["stability_needed"] == pytest.approx(0.05) and "machine_drift" not in row  # 0.15 / 3
    assert {"serve.log", "bench.log", "bench.json"} <= {p.name for p in (tmp_path / "colocated").iterdir()}


def test_scaled_profile_multiplies_each_phase():
    from pdserve.validate.calibrate import scaled
    from pdserve.latency.profiled import ProfiledLatency

    base = ProfiledLatency((0.1, 1e-3, 1e-6), (0.05, 0.01, 1e-6), decode_batch_base=((1, 0.05), (4, 0.2)),
                           decode_context_s=1e-6)
    twice = scaled(base, 2.0, 0.5)
    assert twice.prefill_s(300) == pytest.approx(2 * base.prefill_s(300))
    for batch in (1, 2, 4, 9):
        assert twice.decode_step_s(batch, 1000) == pytest.approx(0.5 * base.decode_step_s(batch, 1000))
    with pytest.raises(ValueError):
        scaled(base, 0.0, 1.0)


def test_implausible_calibration_is_refused():
    from pdserve.validate.calibrate import Calibration, check_plausible

    check_plausible(Calibration(1000, 100, 11.0, 0.09, 10.7, 0.065))
    with pytest.raises(RuntimeError, match="prefill factor"):  # e.g. a prompt answered from the prefix cache
        check_plausible(Calibration(1000, 100, 0.8, 0.09, 16.1, 0.065))


def test_burst_clocks_and_sample_goodput_of_a_constant_model():
    """One prefill at a time: the second request of a 2-burst waits for the first; colocated
    replicas take one request each. The sample prediction is the simulator's own goodput search."""
    from pdserve.bench.lengths import fixed
    from pdserve.bench.metrics import Slo
    from pdserve.bench.workload import WorkloadConfig
    from pdserve.latency.geometry import load_model_spec
    from pdserve.latency.hardware import load_hardware
    from pdserve.latency.base import ConstantLatency
    from pdserve.search.planner import PlanInputs, burst_clocks, plan, sample_goodput

    inputs = PlanInputs(model=load_model_spec("tiny"), hardware=load_hardware("a100-80g"), gpus=2,
                        workload=WorkloadConfig(num_requests=200, input_len=fixed(64), output_len=fixed(8)),
                        slo=Slo(0.2, 0.05), chunk_budgets=(512,), max_seqs=16,
                        fixed_model=ConstantLatency(prefill_ms=20, decode_step_ms=5))
    result = plan(inputs)
    ttft, tpot = burst_clocks(inputs, result.disaggregated, 64, 8, 2, 1000.0)
    assert ttft == pytest.approx((0.020 + 0.039) / 2)  # 20 ms, then 40 ms from t=0 minus the 1 ms gap
    assert tpot == pytest.approx(0.005)
    ttft, tpot = burst_clocks(inputs, result.colocated, 64, 8, 2, 1000.0)
    assert ttft == pytest.approx(0.020) and tpot == pytest.approx(0.005)
    found = sample_goodput(inputs, result.disaggregated, 50)
    assert found.rate > 0 and not found.saturated


def test_load_plan_rate_and_size():
    from pdserve.validate.calibrate import LOAD_MAX_REQUESTS, load_plan

    assert load_plan(1.0, 2) == (LOAD_MAX_REQUESTS, 0.5)  # half the prediction, 12 requests
    count, rate = load_plan(0.02, 2)  # a slow deployment: 4 requests within the span cap
    assert count == 4 and rate == pytest.approx(4 / 300)
    with pytest.raises(ValueError):
        load_plan(0.0, 2)


def test_load_calibration_fits_factors_request_by_request():
    """Replayed requests against a stand-in server, and a simulator whose clocks are half the
    measured medians: both factors come out 2. With a simulator whose TTFT grows faster than the
    factor (queueing: a f + a f^2, 6a = the measured TTFT), the fit lands at 2, where the scaled
    simulation matches the measurement, not at the raw ratio (3). The simulated clocks are set from
    the measured ones, so how long the machine took to answer moves no expected value."""
    from pdserve.bench.records import RequestRecord
    from pdserve.bench.standin import StandinConfig, StandinProcess
    from pdserve.validate.calibrate import fit_load, load_replay

    server = StandinConfig(first_token_s=0.04, prefill_s_per_token=0.0, inter_token_s=0.02)
    n, out = 6, 5
    with StandinProcess(server) as s:
        measured = load_replay(s.url, ["--input-len", "16", "--output-len", str(out)], n, 20.0, seed=3)
    assert len(measured) == n and all(r["success"] for r in measured)
    ttft, tpot = (statistics.median(r[key] for r in measured) for key in ("ttft_s", "tpot_s"))
    assert ttft > 0.039 and tpot > 0.0195  # the stand-in sleeps 40 ms, then 20 ms a token (the bounds it had)

    def records(ttft_s: float, decode: float) -> list:
        return [RequestRecord(i, 0.0, True, ttft_s, ttft_s + (out - 1) * tpot / 2 * decode, (), out, 16)
                for i in range(n)]

    cal = fit_load(measured, lambda prefill, decode: records(ttft / 2 * prefill, decode), seed=3, rate=20.0)
    assert cal.prefill_factor == pytest.approx(2.0, rel=1e-4) and cal.decode_factor == pytest.approx(2.0, rel=1e-4)
    assert cal.predicted_ttft_s == pytest.approx(ttft) and cal.predicted_tpot_s == pytest.approx(tpot)
    assert cal.to_dict()["method"] == "load" and cal.requests == n

    a = ttft / 6
    cal = fit_load(measured, lambda prefill, decode: records(a * prefill + a * prefill**2, decode), seed=3, rate=20.0)
    assert cal.prefill_factor == pytest.approx(2.0, rel=1e-4)  # the raw ratio at factor 1: ttft / 2a = 3
    assert cal.predicted_ttft_s == pytest.approx(ttft, rel=1e-3)


def test_load_clocks_replay_the_workload_on_the_calibration_seed():
    from pdserve.bench.lengths import fixed
    from pdserve.bench.metrics import Slo
    from pdserve.bench.workload import WorkloadConfig
    from pdserve.latency.geometry import load_model_spec
    from pdserve.latency.hardware import load_hardware
    from pdserve.latency.base import ConstantLatency
    from pdserve.search.planner import PlanInputs, load_clocks, plan

    inputs = PlanInputs(model=load_model_spec("tiny"), hardware=load_hardware("a100-80g"), gpus=2,
                        workload=WorkloadConfig(num_requests=200, input_len=fixed(64), output_len=fixed(8)),
                        slo=Slo(0.2, 0.05), chunk_budgets=(512,), max_seqs=16,
                        fixed_model=ConstantLatency(prefill_ms=20, decode_step_ms=5))
    result = plan(inputs)
    records = load_clocks(inputs, result.disaggregated, 5, 0.5, seed=11)
    assert [r.request_id for r in records] == list(range(5))
    assert all(r.success and r.ttft_s == pytest.approx(0.020) and r.tpot_s == pytest.approx(0.005) for r in records)


def test_validate_recalibrates_before_each_point_on_a_live_server(tmp_path):
    """--validate-recalibrate: one server, a calibration burst (with its own prompt salt) before each
    bench point, each point at the rate its own prediction gives, the point's content salted."""
    from pdserve.validate.calibrate import burst_requests

    seen = []

    def calibrator(config, url, round_):
        seen.append(burst_requests(url, (0.01, 0.005), 16, 4, burst=1, repeats=1, content_salt=round_))
        return {"round": round_}, [8.0, 16.0][round_]

    config = v.LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=50.0,
                           extra_serve_args=("--dtype", "float32"))
    bench = ["--num-requests", "4", "--input-len", "16", "--output-len", "4", *LOOSE_SLOS,
             "--prompt-format", "ids", "--seed", "0"]
    row = vrun.validate([config], "tiny", bench, tolerance=0.15, calibrator=calibrator, keep_dir=tmp_path,
                     recalibrate=True)[0]
    assert "error" not in row, row.get("error")
    assert len(seen) == 2 and all(c.measured_ttft_s > 0 for c in seen)
    assert row["bracket_rps"] == [6.957, 18.82]  # 8.0 / 1.15, then 16.0 / 0.85
    assert [p["passed"] for p in row["points"]] == [True, True] and row["measured_vs_prediction"] == "above"
    kept = tmp_path / "colocated"
    salts = [json.loads((kept / f"bench-{k}.json").read_text())["workload"]["content_salt"] for k in (0, 1)]
    assert salts == [0, 1]


def test_plan_load_calibrator_recovers_known_factors_and_reports_elasticity(monkeypatch):
    """`plan --validate-calibrate load` wiring: the replay is stood in by the simulator's own clocks
    with the profile 1.3x slower in prefill and 1.1x in decode; the calibrator must find those
    factors, predict the sample goodput of the scaled profile, and report a positive elasticity.
    Each round salts the replay's prompts with its index."""
    import dataclasses

    from pdserve.bench.lengths import parse_length_spec
    from pdserve.bench.metrics import Slo
    from pdserve.bench.workload import WorkloadConfig
    from pdserve.validate import calibrate
    from pdserve.latency.geometry import load_model_spec
    from pdserve.latency.hardware import load_hardware
    from pdserve.validate.plan_calibrator import plan_calibrator
    from pdserve.search.planner import PlanInputs, load_clocks, plan, sample_goodput
    from pdserve.latency.profiled import ProfiledLatency

    profile = ProfiledLatency((0.05, 1e-3, 1e-7), (0.03, 0.004, 0.0), decode_batch_base=((1, 0.03), (4, 0.045)))
    inputs = PlanInputs(model=load_model_spec("tiny"), hardware=load_hardware("a100-80g"), gpus=2,
                        workload=WorkloadConfig(num_requests=60, input_len=parse_length_spec("uniform:64,256"),
                                                           output_len=parse_length_spec("uniform:8,16")),
                        slo=Slo(1.5, 0.08), chunk_budgets=(512,), max_seqs=16, fixed_model=profile)
    result = plan(inputs)
    slow = dataclasses.replace(inputs, fixed_model=calibrate.scaled(profile, 1.3, 1.1))
    salts, loads = [], []

    def replay(url, workload_args, count, rate, seed, content_salt=0):
        salts.append(content_salt)
        loads.append((count, rate))
        records = load_clocks(slow, result.disaggregated, count, rate, seed)
        return [{"request_id": r.request_id, "success": r.success, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s}
                for r in records]

    monkeypatch.setattr(calibrate, "load_replay", replay)
    run = plan_calibrator(result, 12, "load", ["--input-dist", "uniform:64,256", "--output-dist", "uniform:8,16"])
    config = v.LocalConfig("disaggregated", "disaggregated", predicted_goodput_rps=result.disaggregated.goodput_rps,
                           sample_goodput_rps=sample_goodput(inputs, result.disaggregated, 12).rate)
    details, predicted = run(config, "http://unused", 1)
    assert salts == [1]
    assert details["prefill_factor"] == pytest.approx(1.3, rel=0.03)
    assert details["decode_factor"] == pytest.approx(1.1, rel=0.03)
    scaled = dataclasses.replace(inputs, fixed_model=calibrate.scaled(profile, details["prefill_factor"],
                                                                      details["decode_factor"]))
    assert predicted == sample_goodput(scaled, result.disaggregated, 12).rate
    assert details["goodput_elasticity"] is not None and details["goodput_elasticity"] > 0
    # the window check's halves: a load nearer the prediction, then a fit against another model
    measured = run.measure(config, "http://unused", 2, (0.9, 24, predicted))
    assert loads[-1] == calibrate.load_plan(predicted, config.workers, 0.9, 24) and salts[-1] == 2
    assert loads[-1][0] > loads[0][0]
    details, predicted = run.fit(config, measured, calibrate.scaled(profile, 1.3, 1.1))
    assert details["prefill_factor"] == pytest.approx(1.0, rel=0.03)  # that model already is the server's speed
    assert details["decode_factor"] == pytest.approx(1.0, rel=0.03)


def test_window_check_reads_the_live_servers_step_logs(tmp_path):
    """--validate-recalibrate with a live model: the server writes its engine step logs, and each
    point's calibration and bench windows are read from them (steps of both phases counted), the
    drift and window prediction computed from them, and the bounds and verdict reported."""
    from pdserve.validate.calibrate import burst_requests
    from pdserve.latency.profiled import ProfiledLatency
    from pdserve.validate.windows import LiveModel, SplitCalibrator

    def measure(config, url, round_, load):
        burst_requests(url, (0.01, 0.005), 16, 4, burst=1, repeats=1, content_salt=round_)

    def fit(config, measured, model):
        shaped.append(model)
        return {"prefill_factor": 1.0, "decode_factor": 1.0}, 40.0

    shaped = []
    profile = ProfiledLatency((0.002, 1e-5, 0.0), (0.002, 1e-4, 0.0))
    live = LiveModel(profile, lambda config, p, d, model=None: 40.0 / (p * d))
    calibrator = SplitCalibrator(measure, fit)
    config = v.LocalConfig("disaggregated", "disaggregated", predicted_goodput_rps=40.0,
                           extra_serve_args=("--dtype", "float32"))
    bench = ["--num-requests", "4", "--input-len", "16", "--output-len", "4", *LOOSE_SLOS,
             "--prompt-format", "ids", "--seed", "0"]
    row = vrun.validate([config], "tiny", bench, tolerance=0.15, calibrator=calibrator, keep_dir=tmp_path,
                     recalibrate=True, live=live, max_points=2)[0]
    assert "error" not in row, row.get("error")
    assert row["method"] == "windows" and 1 <= len(row["points"]) <= 2
    first = row["points"][0]
    assert first["calibration_steps"]["prefill_steps"] >= 1 and first["calibration_steps"]["decode_steps"] >= 3
    assert first["bench_steps"]["prefill_steps"] >= 1 and first["bench_steps"]["decode_steps"] >= 3
    dp, dd = first["drift"]
    assert first["window_goodput_rps"] == pytest.approx(40.0 / (dp * dd))
    assert first["error_bound"] == pytest.approx(first["window_goodput_rps"] / first["rate"])
    # a burst of one request decodes 3 steps: too few to re-measure any batch size (served_shape.MIN_STEPS)
    # (the first fit is the half-load anchor's, against the plan's own profile: None)
    assert shaped[0] is None and all(m is profile for m in shaped[1:]) and first["served_decode_bases"] is None
    assert sorted(p.name for p in (tmp_path / "disaggregated" / "trace").glob("*.steps.jsonl")) == \
        ["decode-0.steps.jsonl", "prefill-0.steps.jsonl"]
    json.dumps(row)
