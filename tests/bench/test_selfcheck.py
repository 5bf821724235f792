"""`pdserve bench-client`: the client's own TTFT error is measured and reported."""

from __future__ import annotations

import json

from pdserve.bench.selfcheck import ClientCheckConfig, check_client
from pdserve.cli import main


def test_client_error_is_small_at_moderate_load():
    report = check_client(ClientCheckConfig(rate=50.0, num_requests=100, first_token_s=0.01, inter_token_s=0.002))
    assert report["completed"] == 100
    assert 0.0 <= report["p50_ttft_error_ms"] < 5.0  # a loose bound: CI machines are noisy
    assert report["p50_ttft_error_vs_nominal_ms"] >= report["p50_ttft_error_ms"] - 0.5
    assert set(report) >= {"p99_ttft_error_ms", "max_ttft_error_ms", "within_1ms_at_p99", "max_send_lag_ms"}


def test_bench_client_command_writes_json(tmp_path):
    path = tmp_path / "client.json"
    code = main(["bench-client", "--rate", "50", "--num-requests", "40", "--quiet", "--json", str(path)])
    report = json.loads(path.read_text())
    assert code == (0 if report["within_1ms_at_p99"] else 1)
    assert report["rate"] == 50.0 and report["completed"] == 40
