"""`pdserve simulate`, `plan`, `bench-sim` and `profile` from the command line."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main


def _json_line(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def test_simulate_prints_the_benchmark_keys(tmp_path, capsys):
    model = tmp_path / "m.json"
    model.write_text('{"kind": "constant", "prefill_ms": 10, "decode_step_ms": 5}')
    argv = ["simulate", "--latency-model", str(model), "--mode", "disaggregated", "--prefill", "1", "--decode", "1",
            "--max-prefill-batch", "1", "--rate", "50", "--arrival", "poisson", "--num-requests", "500",
            "--input-len", "64", "--output-len", "8", "--seed", "3", "--json"]
    assert main(argv) == 0
    report = _json_line(capsys)
    for key in ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "attainment_joint", "good_request_throughput",
                "num_arrived", "num_rejected"):
        assert key in report
    assert report["num_arrived"] == report["num_finished"] + report["num_rejected"] == 500


def test_simulate_colocated_from_a_trace(tmp_path, capsys):
    model = tmp_path / "m.json"
    model.write_text('{"kind": "constant", "prefill_ms": 10, "decode_step_ms": 5}')
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(f'{{"prompt_len": {16 + i}, "output_len": 4}}' for i in range(40)))
    assert main(["simulate", "--latency-model", str(model), "--mode", "colocated", "--replicas", "2", "--rate", "20",
                 "--trace", str(trace), "--output-len", "4", "--json"]) == 0
    assert _json_line(capsys)["completed"] == 40


def test_simulate_sweep_finds_a_goodput_the_simulator_confirms(tmp_path, capsys):
    model = tmp_path / "m.json"
    model.write_text('{"kind": "constant", "prefill_ms": 20, "decode_step_ms": 5}')
    common = ["simulate", "--latency-model", str(model), "--mode", "disaggregated", "--num-requests", "400",
              "--input-len", "64", "--output-len", "8", "--seed", "3", "--slo-ttft-ms", "100", "--slo-tpot-ms", "50",
              "--json"]
    assert main([*common, "--sweep", "--sweep-rates", "4,8,16,32,64"]) == 0
    sweep = _json_line(capsys)
    goodput = sweep["request_goodput"]
    # one 20 ms prefill at a time: the TTFT objective fails well below the 50 req/s service rate
    assert 4 <= goodput < 50 and not sweep["request_goodput_saturated"]
    assert sweep["request_goodput_phase"] >= goodput  # the phase definition is never stricter
    points = {float(r): p["joint"] for r, p in sweep["points"].items()}
    failing = min(r for r, joint in points.items() if joint < 0.9)
    # bisection between the ladder's 32 and 64 ends within 1% or after 6 halvings (0.5 req/s)
    assert points[goodput] >= 0.9 and goodput < failing <= goodput + max(0.01 * failing, 32 / 2**6) + 1e-9
    assert main([*common, "--rate", str(goodput)]) == 0  # the single-rate run agrees with the sweep's point
    assert _json_line(capsys)["attainment_joint"] == points[goodput]
    with pytest.raises(SystemExit):
        main([*common, "--sweep", "--rate", "5"])


def test_plan_json_shape(capsys):
    argv = ["plan", "--model", "llama-13b-class", "--hardware", "a100-80g", "--gpus", "4", "--input-len", "512",
            "--output-len", "64", "--num-requests", "150", "--slo-ttft-ms", "500", "--slo-tpot-ms", "80",
            "--chunk-budgets", "512", "--max-seqs", "32", "--quiet", "--json"]
    assert main(argv) == 0
    summary = _json_line(capsys)
    assert summary["decision"] in ("colocate", "disaggregate")
    colo, dis = summary["colocated"], summary["disaggregated"]
    assert set(colo) >= {"config", "goodput_rps", "goodput_per_gpu"}
    assert set(dis) >= {"prefill", "decode", "goodput_rps", "goodput_per_gpu", "kv_demand_bytes_per_s", "link_ok"}
    assert set(dis["prefill"]) == {"tp", "pp", "replicas", "goodput_per_replica_rps"}
    assert dis["gpus"] <= 4 and colo["gpus"] <= 4
    assert summary["net_margin"] is not None and "delta_t_s" in summary["net_margin"]
    if summary["decision"] == "disaggregate":
        assert dis["goodput_per_gpu"] > colo["goodput_per_gpu"] * 1.1


def test_plan_accepts_a_bare_config_and_plots(tmp_path, capsys):
    from pdserve.latency.hardware import PROFILE_DIR

    config = tmp_path / "config.json"
    config.write_text((PROFILE_DIR / "llama-13b-class.config.json").read_text())
    png = tmp_path / "p.png"
    argv = ["plan", "--model", str(config), "--hardware", "h100", "--gpus", "2", "--input-len", "256", "--output-len", "32",
            "--num-requests", "100", "--slo-ttft-ms", "300", "--slo-tpot-ms", "60", "--chunk-budgets", "512",
            "--max-seqs", "16", "--quiet", "--plot", str(png)]
    assert main(argv) == 0
    assert "decision:" in capsys.readouterr().out
    assert png.stat().st_size > 1000


def test_bench_sim_reports_rates(capsys):
    assert main(["bench-sim", "--num-requests", "2000", "--json"]) == 0
    report = _json_line(capsys)
    assert report["roofline_finished"] == 2000 and report["roofline_requests_per_s"] > 0


@pytest.mark.timeout(120)
def test_profile_quick_writes_a_usable_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))  # the tiny checkpoint goes here
    out = tmp_path / "prof.json"
    assert main(["profile", "--quick", "--threads", "1", "--repeats", "1", "--block-size", "32", "--out", str(out)]) == 0
    from pdserve.latency.load import load_latency_model

    model = load_latency_model(out)
    assert model.prefill_s(64) > 0 and model.decode_step_s(4, 256) > 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["threads"] == 1 and meta["block_size"] == 32  # the engine a `--block-size 32` server runs


@pytest.mark.parametrize("flag", ["--block-size", "--threads", "--tp", "--repeats", "--kv-cache-mb",
                                  "--max-num-batched-tokens"])
@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_profile_refuses_a_count_that_is_not_positive_at_the_flags(tmp_path, capsys, flag, value):
    """Before, `--block-size 0` ended in a ZeroDivisionError traceback after the checkpoint loaded."""
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--quick", flag, value, "--out", str(tmp_path / "p.json")])
    assert exit_.value.code == 2 and "expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_plan_validate_refuses_bad_recalibration_flags(tmp_path, capsys):
    """Flag errors come before any server starts: a recalibration without a tolerance, and a
    window check allowed no bench point."""
    from pdserve.latency.profiled import ProfiledLatency

    profile = tmp_path / "prof.json"
    profile.write_text(json.dumps(ProfiledLatency((0.01, 1e-4, 0.0), (0.005, 1e-4, 0.0)).to_dict()))
    argv = ["plan", "--model", "tiny", "--latency-model", str(profile), "--gpus", "2", "--input-len", "64",
            "--output-len", "8", "--num-requests", "40", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50",
            "--chunk-budgets", "512", "--max-seqs", "8", "--quiet", "--validate", "--validate-calibrate", "load",
            "--validate-recalibrate"]
    with pytest.raises(SystemExit, match="needs --validate-tolerance"):
        main(argv)
    with pytest.raises(SystemExit, match="at least 1"):
        main([*argv, "--validate-tolerance", "0.15", "--validate-max-points", "0"])
