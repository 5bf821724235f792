"""The benchmark against the stand-in server: measured numbers equal hand-computed ones.

Latencies carry real client, stand-in and loopback overhead: never below the stand-in's exact
schedule, and above it by the scheduling lag of two processes, a few ms on a loaded 2-core
machine (more on a busier one). So every latency check allows OVERHEAD_MS above the schedule,
and the schedules keep each SLO threshold, goodput boundary and percentile further than that from
the value a wrong answer would give; attainment and goodput are then compared exactly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.bench.app import BenchConfig, measure_rate
from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.http.client import EndpointConfig
from pdserve.bench.goodput import SearchPlan
from pdserve.bench.lengths import fixed
from pdserve.bench.metrics import Slo
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.runner import run_requests_sync
from pdserve.bench.standin import StandinConfig, StandinProcess
from pdserve.bench.workload import WorkloadConfig, build_workload
from pdserve.cli import main

OVERHEAD_MS = 50.0  # about 10x the worst lag measured on a loaded 2-core machine


def bench(url, workload, slo=Slo(10.0, 10.0), **kw):
    return BenchConfig(endpoint=EndpointConfig(url, "standin"), workload=workload, slo=slo, quiet=True, **kw)


def constant(n, input_len=fixed(32), output_len=fixed(5), **kw):
    return WorkloadConfig(num_requests=n, input_len=input_len, output_len=output_len, arrival=ArrivalSpec("constant"), **kw)


def test_percentiles_and_attainment_match_hand_computed(tmp_path):
    lens = [10, 20, 30, 40, 50, 160, 170, 180, 190, 200]  # two groups: no percentile lies near another's
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": n, "output_len": 5}) + "\n" for n in lens))
    server = StandinConfig(first_token_s=0.01, prefill_s_per_token=0.002, inter_token_s=0.1)
    workload = WorkloadConfig(num_requests=0, trace_path=str(trace), arrival=ArrivalSpec("constant"))
    slo = Slo(ttft_s=0.220, tpot_s=0.200)
    with StandinProcess(server) as s:
        run = measure_rate(bench(s.url, workload, slo), build_workload(workload), rate=10.0)
    expected_ttft_ms = np.array([10 + 2 * n for n in lens], dtype=float)  # 30 .. 110 and 330 .. 410 ms
    summary = run.summary
    for key, q in (("p50_ttft_ms", 50), ("p90_ttft_ms", 90), ("p99_ttft_ms", 99)):
        assert 0 <= summary[key] - np.percentile(expected_ttft_ms, q) < OVERHEAD_MS, key
    assert 0 <= summary["mean_ttft_ms"] - expected_ttft_ms.mean() < OVERHEAD_MS
    # 100 ms per token; counting 5 gaps instead of 4 (or the first token's wait) would be >= 20 ms off
    assert abs(summary["mean_tpot_ms"] - 100.0) < 15.0 and abs(summary["mean_itl_ms"] - 100.0) < 15.0
    assert 0 <= summary["mean_e2el_ms"] - (expected_ttft_ms.mean() + 400) < OVERHEAD_MS
    # TTFT 30..110 ms meet 220 ms, 330..410 ms miss; every TPOT (100 ms) meets 200 ms.
    assert (summary["attainment_ttft"], summary["attainment_tpot"], summary["attainment_joint"]) == (0.5, 1.0, 0.5)
    assert summary["completed"] == 10 and summary["total_output_tokens"] == 50


def test_failures_and_cut_offs_lower_attainment():
    server = StandinConfig(first_token_s=0.005, inter_token_s=0.002, fail_every=4, cut_off_every=5)
    workload = constant(20)
    with StandinProcess(server) as s:
        run = measure_rate(bench(s.url, workload), build_workload(workload), rate=20.0)
    # n = 4, 8, 12, 16, 20 fail; n = 5, 10, 15 are cut off (n counts requests from 1)
    assert run.summary["failure_reasons"] == {"http:500": 5, "cut_off": 3}
    assert run.summary["completed"] == 12 and run.summary["denominator"] == 20
    assert run.summary["attainment_joint"] == 12 / 20
    failed_ids = sorted(r.request_id for r in run.records if not r.success)
    assert failed_ids == [3, 4, 7, 9, 11, 14, 15, 19]


def test_rejections_count_as_misses():
    server = StandinConfig(first_token_s=0.5, max_concurrency=1)  # the others arrive while the first is in flight
    workload = constant(5, output_len=fixed(1))
    with StandinProcess(server) as s:
        run = measure_rate(bench(s.url, workload), build_workload(workload), rate=float("inf"))
    assert run.summary["failure_reasons"] == {"rejected:429": 4}
    assert run.summary["attainment_ttft"] == 0.2 and run.summary["attainment_tpot"] == 0.2
    assert run.summary["p50_tpot_ms"] is None  # the one success has a single token: no TPOT


def test_warmup_and_cooldown_exclusion_and_denominator():
    server = StandinConfig(first_token_s=0.005, inter_token_s=0.002, fail_every=2)
    workload = constant(20)
    with StandinProcess(server) as s:
        config = bench(s.url, workload, warmup_s=0.45, cooldown_s=0.25)
        run = measure_rate(config, build_workload(workload), rate=10.0)
    # arrivals 0.0 .. 1.9 s: 5 before 0.45 s, 3 after 1.65 s; odd ids fail (even n)
    assert (run.summary["num_excluded_warmup"], run.summary["num_excluded_cooldown"]) == (5, 3)
    assert run.summary["denominator"] == 12 and [r.request_id for r in run.measured] == list(range(5, 17))
    assert run.summary["attainment_joint"] == 0.5 and run.summary["num_requests"] == 20


def test_same_seed_reproduces_arrivals_end_to_end():
    workload = WorkloadConfig(num_requests=12, input_len=fixed(16), output_len=fixed(2), seed=3)
    with StandinProcess(StandinConfig()) as s:
        endpoint = EndpointConfig(s.url, "standin")
        runs = [run_requests_sync(build_workload(workload).at_rate(40.0), endpoint) for _ in range(2)]
    first, second = ([r.arrival_s for r in run.records] for run in runs)
    assert first == second and len(set(first)) == 12
    assert all(r.success for run in runs for r in run.records)
    # a sanity bound on the client's own lag behind the schedule (ms, more on a loaded machine): in seconds
    assert 0 <= max(run.max_send_lag_s for run in runs) < 1.0


def test_goodput_against_a_concurrency_limited_standin():
    # Each request lasts 100 ms + 4 x 25 ms = 200 ms and at most 2 run at once, so constant
    # arrivals are all served up to 2 / 0.2 s = 10 req/s and a third or more are rejected above.
    # A lag only lengthens requests (lowers the goodput); the search tries 5, 20, 12.5, 8.75,
    # 10.625 and 9.6875 req/s. How far below 10 the figure lands depends on the stand-in's lag
    # (8.75 fails once it lags 28 ms, on a loaded machine), so the lower bound is the search's
    # first point, which fails only at a lag of a whole request (at 5 req/s none overlap); the
    # upper bounds are the capacity, which no speed can pass.
    server = StandinConfig(first_token_s=0.1, inter_token_s=0.025, max_concurrency=2)
    workload = constant(16)
    plan = SearchPlan((5.0, 20.0), target=0.9, rel_tol=0.05, max_bisections=4)
    with StandinProcess(server) as s:
        from pdserve.bench.app import run_bench

        outcome = run_bench(bench(s.url, workload, sweep=plan))
    joint, phase = outcome.goodput["joint"], outcome.goodput["phase"]
    assert 5.0 <= joint.rate <= 10.0 and joint.lowest_failing_rate <= 11.0
    assert phase.rate == joint.rate  # rejections miss both clocks alike
    assert outcome.report["request_goodput"] == joint.rate
    assert [p["rate"] for p in outcome.report["sweep"]] == sorted(outcome.runs)


@pytest.mark.parametrize("api,fmt,http_client", [("chat", "text", "raw"), ("completions", "ids", "raw"), ("completions", "text", "httpx")])
def test_apis_prompt_formats_and_transports(api, fmt, http_client):
    workload = WorkloadConfig(num_requests=6, input_len=fixed(20), output_len=fixed(4), prompt_style=PromptStyle(format=fmt))
    with StandinProcess(StandinConfig(inter_token_s=0.001)) as s:
        endpoint = EndpointConfig(s.url, "standin", api=api, http_client=http_client)
        result = run_requests_sync(build_workload(workload).at_rate(50.0), endpoint)
    assert all(r.success and r.output_tokens == 4 and len(r.itls_s) == 3 for r in result.records)


def test_unreachable_endpoint_is_a_recorded_failure():
    workload = constant(2)
    result = run_requests_sync(build_workload(workload).at_rate(100.0), EndpointConfig("http://127.0.0.1:9", "m"))
    assert [r.error for r in result.records] == ["connect_error", "connect_error"]


REQUIRED_KEYS = (
    "completed", "failed", "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
    "attainment_ttft", "attainment_tpot", "attainment_joint", "request_throughput", "output_throughput",
)


def test_cli_single_rate_sweep_and_compare(tmp_path):
    common = ["--num-requests", "8", "--input-len", "16", "--output-dist", "uniform:2,4",
              "--slo-ttft-ms", "200", "--slo-tpot-ms", "50", "--quiet", "--arrival", "constant"]
    # b's first token waits 50 ms, far above a's TTFT (its overhead alone) even on a loaded machine
    with StandinProcess(StandinConfig(inter_token_s=0.002)) as a, StandinProcess(StandinConfig(first_token_s=0.05)) as b:
        assert main(["bench", "--endpoint", a.url, "--rate", "40", "--json", str(tmp_path / "one.json"),
                     "--plot-dir", str(tmp_path / "plots"), *common]) == 0
        assert main(["bench", "--endpoint", a.url, "--sweep", "--sweep-rates", "20,40",
                     "--json", str(tmp_path / "sweep.json"), *common]) == 0
        assert main(["bench", "compare", "--endpoint-a", a.url, "--endpoint-b", b.url, "--rate", "40",
                     "--json", str(tmp_path / "cmp.json"), *common]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    assert all(key in one for key in REQUIRED_KEYS) and one["endpoint"]["model"] == "standin"
    assert one["completed"] == 8 and one["denominator"] == 8
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["attainment_vs_rate.png", "tpot_cdf.png", "ttft_cdf.png"]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["request_goodput"] == 40.0 and sweep["request_goodput_phase"] == 40.0
    assert sweep["goodput_search"]["joint"]["saturated"] is True
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert cmp["a"]["denominator"] == 16 and cmp["b"]["num_rounds"] == 2
    assert cmp["ratio_b_over_a"]["mean_ttft_ms"] > 1.0


def test_max_concurrency_keeps_at_most_n_in_flight():
    """A closed loop of 2 clients against a server that refuses a third request in flight: none is
    refused, and each later request is sent only after an earlier one ended."""
    server = StandinConfig(first_token_s=0.1, inter_token_s=0.01, max_concurrency=2)
    workload = constant(6, output_len=fixed(3))
    with StandinProcess(server) as s:
        run = measure_rate(bench(s.url, workload, max_concurrency=2), build_workload(workload), rate=float("inf"))
    assert run.summary["completed"] == 6 and run.summary["failure_reasons"] == {}
    ends = sorted(r.start_s + r.e2e_s for r in run.records)
    starts = sorted(r.start_s for r in run.records)
    for k in range(2, 6):  # the k-th send waits for the (k - 1)-th end
        assert starts[k] >= ends[k - 2]
    assert all(r.ttft_s < 0.1 + OVERHEAD_MS / 1e3 for r in run.records)  # TTFT counts from the send, not the schedule
