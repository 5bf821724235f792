"""The commands other than `serve` refuse a value no run can use with one error and no traceback,
before anything runs. Before (on 9d188f3): NaN in a latency model hung `simulate`; a negative one,
`--rate nan`, `--input-len -64`, `--attainment 2`, `--holdout 0` or `--flops nan` printed a report
with exit 0; a missing or directory --latency-model, a directory --json/--out, a binary trace or
fixture, `--sweep-factor 1`, `--threads 100000` (a segfault) and a profile of one point ended in
tracebacks, some after the whole run; `--num-requests 10**12` asked numpy for 7 TiB, `--gpus
10**18` never ended; and `demo`, `drill` and `chaos` refused every invocation (port 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main

CONSTANT = '{"kind": "constant", "prefill_ms": 10, "decode_step_ms": 5}'
SIM = ["simulate", "--input-len", "64", "--output-len", "8", "--num-requests", "20", "--rate", "10", "--json"]
BENCH = ["bench", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--slo-ttft-ms", "100", "--slo-tpot-ms", "50",
         "--num-requests", "3", "--input-len", "8", "--output-len", "4", "--quiet"]
pytestmark = pytest.mark.timeout(60)  # before the checks, a NaN latency model and --gpus 10**18 never ended

PLAN = ["plan", "--model", "tiny", "--slo-ttft-ms", "500", "--slo-tpot-ms", "80", "--input-len", "64", "--output-len",
        "8", "--quiet", "--json"]


def _refused(capsys, argv: list[str], said: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and "Traceback" not in err, err


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "m.json"
    path.write_text(CONSTANT)
    return str(path)


@pytest.mark.parametrize("flags, said", [
    (["--rate", "nan"], "argument --rate: expected a number, got 'nan'"),
    (["--input-len", "-64"], "argument --input-len: must be in 1..1048576, got '-64'"),
    (["--output-len", "1000000000000000000"], "argument --output-len: must be in 1..1048576"),
    (["--num-requests", "1000000000000"], "argument --num-requests: must be in 1..10000000"),
    (["--attainment", "2"], "argument --attainment: must be in (0, 1], got '2'"),
    (["--slo-ttft-ms", "-5"], "argument --slo-ttft-ms: must be > 0, got '-5'"),
    (["--burstiness", "nan"], "argument --burstiness: expected a number, got 'nan'"),
    (["--link-gbps", "nan"], "argument --link-gbps: expected a number, got 'nan'"),
    (["--max-prefill-tokens", "0"], "argument --max-prefill-tokens: must be >= 1, got '0'"),
    (["--shared-prefix-len", "-3"], "argument --shared-prefix-len: must be in 0..1048576, got '-3'"),
    (["--sweep", "--sweep-rates", "a,b"], "argument --sweep-rates: expected a number, got 'a'"),
])
def test_simulate_refuses_a_number_no_run_can_use(flags, said, model_file, capsys):
    _refused(capsys, [*SIM, "--latency-model", model_file, *flags], said)


@pytest.mark.parametrize("content, said", [
    (None, "No such file or directory"),
    ("dir", "Is a directory"),
    ("[1, 2, 3]", "a latency model is a JSON object, got list"),
    ('{"kind": "constant", "prefill_ms": NaN, "decode_step_ms": 5}', "prefill_ms = nan: every number must be finite"),
    ('{"kind": "constant", "prefill_ms": -10, "decode_step_ms": 0}', "prefill_ms = -10: every number must be finite"),
])
def test_a_latency_model_file_that_is_missing_or_malformed_is_refused_at_the_flag(tmp_path, capsys, content, said):
    path = tmp_path / "m.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    _refused(capsys, [*SIM, "--latency-model", str(path)], f"argument --latency-model: {path}")
    _refused(capsys, [*PLAN, "--gpus", "2", "--latency-model", str(path)], said)


def test_plan_refuses_a_gpu_budget_no_search_ends_for_and_a_malformed_hardware_file(tmp_path, capsys):
    _refused(capsys, [*PLAN, "--gpus", "1000000000000000000"], "argument --gpus: must be in 1..4096")
    _refused(capsys, [*PLAN, "--gpus", "2", "--chunk-budgets", "a"], "argument --chunk-budgets: expected an integer")
    _refused(capsys, [*PLAN, "--gpus", "2", "--emit-config", str(tmp_path)], "is a directory, not a file path")
    listed = tmp_path / "hw.json"
    listed.write_text("[1]")
    with pytest.raises(SystemExit, match="a hardware profile is a JSON object, got list"):
        main([*PLAN, "--gpus", "2", "--hardware", str(listed)])


@pytest.mark.parametrize("flags, said", [
    (["--rate", "nan"], "argument --rate: expected a number, got 'nan'"),
    (["--rate", "-1"], "argument --rate: must be > 0 (or inf), got '-1'"),
    (["--sweep", "--sweep-factor", "1"], "argument --sweep-factor: must be > 1, got '1'"),
    (["--sweep", "--sweep-rates", "a,b"], "argument --sweep-rates: expected a number, got 'a'"),
    (["--rate", "1", "--tokenizer-bytes-per-token", "0"], "argument --tokenizer-bytes-per-token: must be > 0"),
    (["--rate", "1", "--request-timeout-s", "nan"], "argument --request-timeout-s: expected a number"),
    (["--rate", "1", "--max-tokens", "-3"], "argument --max-tokens: must be in 1..1048576, got '-3'"),
    (["--rate", "1", "--cooldown-s", "nan"], "argument --cooldown-s: expected a number"),
])
def test_bench_refuses_a_number_before_any_request(flags, said, capsys):
    _refused(capsys, [*BENCH, *flags], said)


def test_bench_checks_its_json_path_before_the_run_and_names_a_server_that_is_not_there(tmp_path, capsys):
    _refused(capsys, [*BENCH, "--rate", "1", "--json", str(tmp_path)], "argument --json: ")
    argv = [a for a in BENCH if a not in ("--model", "m")]
    with pytest.raises(SystemExit, match=r"error: cannot list the models at http://127.0.0.1:9/v1/models"):
        main([*argv, "--rate", "1"])
    assert "Traceback" not in capsys.readouterr().err


def test_ledger_phase_cost_refuses_rates_that_are_not_finite(capsys):
    argv = ["ledger", "phase-cost", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--bytes", "2",
            "--d-model", "64", "--d-ff", "160", "--q-heads", "8", "--prefill-new", "16", "--decode-lengths", "4,8"]
    _refused(capsys, [*argv, "--flops", "nan", "--mem-bw", "1e12"], "argument --flops: expected a number, got 'nan'")
    _refused(capsys, [*argv, "--flops", "inf", "--mem-bw", "inf"], "argument --flops: must be a finite number")


def test_trace_and_check_read_a_binary_or_mistyped_file_as_a_bad_file(tmp_path, capsys):
    binary = tmp_path / "rnd.bin"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    assert main(["trace", "analyze", str(binary)]) == 2
    assert "can't decode" in capsys.readouterr().out
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"request_id": "a", "prompt_tokens": "abc", "pd_decision": "local"}\n')
    assert main(["trace", "analyze", str(requests)]) == 2
    assert "invalid literal" in capsys.readouterr().out
    assert main(["check", "phase-cost", str(binary)]) == 1
    assert "FAIL phase-cost: cannot read fixture" in capsys.readouterr().out


@pytest.mark.timeout(20)
@pytest.mark.parametrize("field, value, said", [
    ("target_rps", float("nan"), "malformed fixture: ValueError"),
    ("low_affinity.stages", 10**18, "expected 0..999999999999999999"),  # a MemoryError: list(range(10**18))
])
def test_check_fails_a_fixture_whose_number_no_placement_has(tmp_path, capsys, field, value, said):
    from pdserve.ledger.checks import load_fixture

    fixture = load_fixture("distserve-placement")
    *parents, leaf = field.split(".")
    node = fixture
    for key in parents:
        node = node[key]
    node[leaf] = value
    path = tmp_path / "f.json"
    path.write_text(json.dumps(fixture))
    assert main(["check", "distserve-placement", str(path)]) == 1
    out = capsys.readouterr()
    assert said in out.out and "Traceback" not in out.err, out


def test_predictor_refuses_a_holdout_that_scores_nothing_and_a_trace_of_lists(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("[1, 2]\n")
    for holdout in ("0", "1", "-1"):
        _refused(capsys, ["predictor", "train", str(trace), "--out", str(tmp_path / "p.json"), "--holdout", holdout],
                 f"argument --holdout: must be between 0 and 1 (exclusive), got '{holdout}'")
    _refused(capsys, ["predictor", "synth", "--out", str(tmp_path), "--n", "10"], "is a directory")
    _refused(capsys, ["predictor", "synth", "--out", str(trace), "--n", "-5"], "argument --n: must be in 1..10000000")
    _refused(capsys, ["predictor", "synth", "--out", str(trace), "--noise", "nan"], "argument --noise")
    assert main(["predictor", "train", str(trace), "--out", str(tmp_path / "p.json"), "--model", "tiny"]) == 2
    assert "a training line needs 'prompt' text and 'output_len'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [
    (["--threads", "100000"], "--threads 100000 is more than the"),  # a segfault
    (["--prompt-lens", "8", "--batches", "1", "--contexts", "8"], "a profile fit needs at least two prefill points"),
    (["--prompt-lens", "100000000,8"], "a point of 100000000 tokens"),
    (["--batches", "100000000,1"], "--batches 100000000 at"),
    (["--tp", "3"], "tensor-parallel size 3 does not divide"),
])
def test_profile_refuses_a_plan_it_cannot_measure_before_measuring(tiny_model_dir, tmp_path, capsys, flags, said):
    out = tmp_path / "p.json"
    assert main(["profile", "--quick", "--model", str(tiny_model_dir), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err
    assert not out.exists()


def test_profile_refuses_an_output_path_it_cannot_write_and_a_model_that_is_not_there(tmp_path, capsys):
    _refused(capsys, ["profile", "--quick", "--out", str(tmp_path)], "argument --out: ")
    assert main(["profile", "--quick", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "p.json")]) == 2
    assert "model directory does not exist" in capsys.readouterr().err


def test_demo_drill_and_chaos_start_with_valid_flags_and_refuse_a_bad_model(tiny_model_dir, monkeypatch, tmp_path, capsys):
    """Valid flags reach the run (stubbed here: no cluster starts); a model that is not there is
    refused with the serve pre-flight's line instead of starting workers on it."""
    import pdserve.api.exercises.demo as demo

    seen = []

    async def fake_run_demo(config, spec):
        seen.append((config.port, spec.num_requests))
        return {"failed": 0, "exact_match": True}

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    assert main(["demo", "--model", str(tiny_model_dir), "--num-requests", "2", "--json"]) == 0
    assert seen and 0 < seen[0][0] < 65536 and seen[0][1] == 2
    for command in ("demo", "drill", "chaos"):
        assert main([command, "--model", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model directory does not exist" in err[0], (command, err)
    _refused(capsys, ["drill", "--minutes", "nan"], "argument --minutes: expected a number, got 'nan'")
    _refused(capsys, ["chaos", "--kill-every", "-1"], "argument --kill-every: must be > 0, got '-1'")
    _refused(capsys, ["demo", "--num-requests", "0"], "argument --num-requests: must be in 1..10000, got '0'")
