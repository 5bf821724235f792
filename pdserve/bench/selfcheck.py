"""Is the client the bottleneck? Its own TTFT measurement error against the stand-in.

The stand-in records, per request id, the TTFT it actually delivered (kernel arrival of the
request -> first token handed to the kernel). The client measures TTFT from just before it takes
a connection for the request to the arrival stamp of the first data line (`stampedsock`: the
kernel's stamp, so the client's event-loop lag after arrival is not in it). Their difference is
what the benchmark adds: connection handling, request serialisation, the send and the loopback
network. We report its percentiles at a given offered rate, and also the error against the
nominal (configured) delay, which adds the stand-in's own timer lag.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import numpy as np

from pdserve.bench.http import stampedsock
from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.http.client import EndpointConfig
from pdserve.bench.lengths import fixed
from pdserve.bench.runner import run_requests
from pdserve.bench.standin import StandinConfig, StandinProcess
from pdserve.bench.workload import WorkloadConfig, build_workload
from pdserve.loop import run as run_loop


@dataclass(frozen=True)
class ClientCheckConfig:
    """The offered load and the stand-in's timing."""

    rate: float = 200.0
    num_requests: int = 2000
    input_len: int = 128
    output_len: int = 8
    first_token_s: float = 0.02
    inter_token_s: float = 0.005
    arrival: str = "poisson"
    seed: int = 0


def check_client(config: ClientCheckConfig, quiet: bool = True) -> dict:
    """Run the check against a fresh stand-in process; returns the report dictionary."""
    standin = StandinConfig(first_token_s=config.first_token_s, inter_token_s=config.inter_token_s)
    with StandinProcess(standin) as server:
        return run_loop(_measure(server.url, config, quiet))


async def _measure(url: str, config: ClientCheckConfig, quiet: bool) -> dict:
    workload = build_workload(
        WorkloadConfig(
            num_requests=config.num_requests,
            input_len=fixed(config.input_len),
            output_len=fixed(config.output_len),
            seed=config.seed,
            arrival=ArrivalSpec(config.arrival),
        )
    )
    endpoint = EndpointConfig(base_url=url, model="standin")
    result = await run_requests(workload.at_rate(config.rate), endpoint, quiet=quiet, label="bench-client")
    async with httpx.AsyncClient(trust_env=False) as client:
        server_ttft_s = (await client.get(url + "/standin/stats")).json()["server_ttft_s"]
    return _report(config, result, server_ttft_s)


def _report(config: ClientCheckConfig, result, server_ttft_s: dict[str, float]) -> dict:
    measured = [r for r in result.records if r.success and str(r.request_id) in server_ttft_s]
    error_ms = np.array([(r.ttft_s - server_ttft_s[str(r.request_id)]) * 1e3 for r in measured])
    nominal_ms = np.array([(r.ttft_s - config.first_token_s) * 1e3 for r in measured])
    report = {
        "rate": config.rate,
        "num_requests": config.num_requests,
        "completed": len(measured),
        "achieved_request_rate": len(result.records) / result.wall_s if result.wall_s else 0.0,
        "max_send_lag_ms": result.max_send_lag_s * 1e3,
        "first_token_ms": config.first_token_s * 1e3,
        "percentile_method": "numpy linear interpolation",
        "receive_stamps": "kernel (SO_TIMESTAMPNS)" if stampedsock.SO_TIMESTAMPNS is not None else "read time",
    }
    for name, values in (("ttft_error", error_ms), ("ttft_error_vs_nominal", nominal_ms)):
        for q in (50, 90, 99):
            report[f"p{q}_{name}_ms"] = float(np.percentile(values, q)) if len(values) else None
        report[f"max_{name}_ms"] = float(values.max()) if len(values) else None
    report["within_1ms_at_p99"] = bool(report["p99_ttft_error_ms"] is not None and report["p99_ttft_error_ms"] <= 1.0)
    return report
