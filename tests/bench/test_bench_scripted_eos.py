"""`pdserve bench --max-tokens N`: every request asks for N tokens and ends at its own length
through pdserve's scripted end of sequence, a request header outside the OpenAI body; pdserve
honours it, the body field is not part of the public API, and against a server that ignores the
header the benchmark says so (the stand-in emits max_tokens whatever it is told). pdserve's side:
tests/api/test_api_scripted_eos.py."""

from __future__ import annotations

from dataclasses import replace

from pdserve.api.protocol import SCRIPTED_EOS_HEADER
from pdserve.bench.app import BenchConfig, measure_rate
from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.cli_args import endpoint_config
from pdserve.bench.http.client import EndpointConfig, request_body, request_headers
from pdserve.bench.lengths import fixed
from pdserve.bench.metrics import Slo
from pdserve.bench.standin import StandinConfig, StandinProcess
from pdserve.bench.workload import WorkloadConfig, build_workload
from pdserve.cli import build_parser


def test_max_tokens_with_the_requests_length_as_a_scripted_eos_header():
    request = build_workload(WorkloadConfig(num_requests=1)).requests[0]
    endpoint = EndpointConfig("http://x", "m", max_tokens=1024)
    body = request_body(request, endpoint)
    assert body["max_tokens"] == 1024 and "scripted_eos_tokens" not in body  # nothing private in the OpenAI body
    assert request_headers(request, endpoint, "r1") == {"x-request-id": "r1", SCRIPTED_EOS_HEADER: str(request.output_tokens)}
    assert request_headers(request, EndpointConfig("http://x", "m"), "r1") == {"x-request-id": "r1"}
    args = build_parser().parse_args(["bench", "--endpoint", "http://x", "--max-tokens", "1024"])
    assert endpoint_config(args, "http://x", "m").max_tokens == 1024


def test_the_benchmark_says_when_the_server_ignores_the_scripted_end(capsys):
    workload = WorkloadConfig(num_requests=4, input_len=fixed(8), output_len=fixed(3), arrival=ArrivalSpec("constant"))
    with StandinProcess(StandinConfig(first_token_s=0.001, inter_token_s=0.001)) as s:
        config = BenchConfig(endpoint=EndpointConfig(s.url, "standin", max_tokens=6), workload=workload,
                             slo=Slo(10.0, 10.0), quiet=True)
        run = measure_rate(config, build_workload(workload), rate=50.0)
        honest = measure_rate(replace(config, endpoint=EndpointConfig(s.url, "standin")), build_workload(workload), 50.0)
    assert run.summary["scripted_eos_ignored"] == 4
    assert "ignored the scripted end of sequence on 4 of 4 requests" in capsys.readouterr().err
    assert "scripted_eos_ignored" not in honest.summary  # no --max-tokens: nothing scripted, nothing to check
