"""`pdserve bench --max-tokens N`: every request asks for N tokens and ends at its own length."""

from __future__ import annotations

from pdserve.bench.client import EndpointConfig, request_body
from pdserve.bench.workload import WorkloadConfig, build_workload
from pdserve.cli import build_parser
from pdserve.bench.cli_args import endpoint_config


def test_max_tokens_with_the_requests_length_as_a_scripted_eos():
    request = build_workload(WorkloadConfig(num_requests=1)).requests[0]
    body = request_body(request, EndpointConfig("http://x", "m", max_tokens=1024))
    assert (body["max_tokens"], body["scripted_eos_tokens"]) == (1024, request.output_tokens)
    assert "scripted_eos_tokens" not in request_body(request, EndpointConfig("http://x", "m"))
    args = build_parser().parse_args(["bench", "--endpoint", "http://x", "--max-tokens", "1024"])
    assert endpoint_config(args, "http://x", "m").max_tokens == 1024
