"""`pdserve serve` refuses a flag value no deployment can run with: exit 2 and one `error:` line
naming the flag, before any worker, fit or socket starts. Before these checks each of them
started the cluster and then misbehaved: a port past 65535 printed "serving on :99999" and never
bound, a 0 MB pool or 0 sequences served requests that could never run, and a block size of 0,
a 0-token step budget, a TP size that does not divide the heads or a missing checkpoint ended in
a traceback (some after a worker had crashed and been restarted into the same error)."""

from __future__ import annotations

import socket

import pytest

from pdserve.cli import main

BAD = [
    (("--port", "99999"), "--port must be in 1..65535"),
    (("--port", "0"), "--port must be in 1..65535"),
    (("--kv-cache-mb", "0"), "(--kv-cache-mb) must be > 0"),
    (("--host-kv-mb", "-1"), "(--host-kv-mb) must be >= 0"),
    (("--block-size", "0"), "(--block-size) must be >= 1"),
    (("--max-num-seqs", "0"), "(--max-num-seqs) must be >= 1"),
    (("--max-num-batched-tokens", "0"), "(--max-num-batched-tokens) must be >= 1"),
    (("--max-tenant-roots", "0"), "(--max-tenant-roots) must be >= 1"),
    (("--threads-per-worker", "0"), "--threads-per-worker must be >= 1"),
    (("--slo-ttft-ms", "-1"), "--slo-ttft-ms must be > 0"),
    (("--slo-tpot-ms", "0"), "--slo-tpot-ms must be > 0"),
    (("--admission-wait-s", "-1"), "--admission-wait-s must be >= 0"),
    (("--tp", "3"), "tensor-parallel size 3 does not divide the model's 8 query heads"),
    (("--decode-tp", "3"), "tensor-parallel size 3 does not divide"),
    (("--model", "/nonexistent/checkpoint"), "model directory does not exist"),
    (("--mode", "colocated", "--replicas", "-1"), "worker counts must be >= 0, got --replicas -1"),  # not "--prefill 0 ..."
    (("--tp", "0"), "tensor-parallel size of prefill workers must be >= 1, got 0"),  # was taken as 1
    (("--block-size", "100000000"), "--block-size 100000000 is longer than the model's"),  # started, then hung
    (("--block-size", "1024", "--kv-cache-mb", "1"), "--kv-cache-mb 1 holds no block of 1024 tokens"),
    (("--kv-cache-mb", "100000000"), "workers' K/V pools"),  # ENOMEM tracebacks in the workers
    (("--host-kv-mb", "100000000"), "workers' K/V pools"),
    (("--threads-per-worker", "100000"), "--threads-per-worker 100000 is more than the"),  # the fit's traceback
    (("--device", "banana", "--mode", "colocated"), "device (--device) must be cpu, cuda or cuda:N, got 'banana'"),
    (("--admin-token-file", "/nonexistent/token"), "No such file or directory"),  # tracebacks, each
    (("--api-keys", "/nonexistent/keys"), "No such file or directory"),
    (("--pd-profile", "/nonexistent/profile.json"), "No such file or directory"),
    (("--kv-events-replay-endpoint", "garbage"), "--kv-events-replay-endpoint replays what --kv-events-endpoint"),
    (("--kv-events-endpoint", "tcp://192.0.2.1:5555"), "worker 0 cannot bind port 5555"),  # crash-looped the workers
    (("--device", "CPU"), "device (--device) must be cpu, cuda or cuda:N, got 'CPU'"),
]


pytestmark = pytest.mark.timeout(60)  # a check that regressed would start a real server here

NOT_FINITE = ["--lease-s", "--heartbeat-timeout-s", "--crash-window-s", "--admission-wait-s", "--slo-ttft-ms",
              "--pd-safety-margin-ms", "--prompt-age-override-ms", "--startup-timeout-s"]


@pytest.mark.parametrize("flags, said", BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_a_value_no_deployment_can_run_with_is_refused_before_anything_starts(flags, said, capsys):
    assert main(["serve", "--model", "tiny", "--port", "18999", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


@pytest.mark.parametrize("flag", NOT_FINITE)
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_float_flag_refuses_nan_and_inf_at_the_parse(flag, value, capsys):
    """Before: nan and inf reached the workers as JSON null (a worker that could not read its
    configuration), an OverflowError, or a server with an infinite deadline."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "tiny", "--port", "18999", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be a finite number, got '{value}'" in capsys.readouterr().err


def test_a_port_in_use_and_a_host_not_of_this_machine_are_refused_before_any_worker(capsys):
    """Before: the workers started, the log said "serving on ...", then uvicorn's bind failed (exit 3)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: cannot listen on --host 127.0.0.1 --port {port}: Address already in use"], err
    assert main(["serve", "--model", "tiny", "--host", "192.0.2.1", "--port", "18999"]) == 2  # TEST-NET-1
    assert "error: cannot listen on --host 192.0.2.1" in capsys.readouterr().err


def test_files_the_server_reads_later_are_read_at_the_flags(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    keys = tmp_path / "keys"
    keys.write_text("key-1 tenant-a extra\n")
    taken = tmp_path / "a-file"
    taken.write_text("")
    not_a_fit = tmp_path / "dict.json"
    not_a_fit.write_text('{"a": 1}')
    for flags, said in ((("--pd-profile", str(bad)), "not JSON"), (("--api-keys", str(keys)), "--api-keys"),
                        (("--pd-profile", str(not_a_fit)), "not a `pdserve profile` fit (prefill_coef and decode_coef of three numbers each)"),
                        (("--trace-dir", str(taken)), "File exists")):
        assert main(["serve", "--model", "tiny", "--port", "18999", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], (flags, err)


def test_a_deployment_the_cost_model_cannot_be_fitted_for_fails_with_one_line_and_no_worker(capsys):
    """A step budget below the fit's prompt points (the default --pd-profile auto fits at start):
    before, two tracebacks (the fit's child and the server's RuntimeError), exit 1."""
    assert main(["serve", "--model", "tiny", "--port", "18999", "--max-num-batched-tokens", "8"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("error: the router's cost-model fit (--pd-profile auto) failed: a profile fit "
                                            "needs at least two prefill and two decode points; `--pd-profile none` "
                                            "serves without one"), err
