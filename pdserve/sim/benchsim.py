"""Simulator speed: requests simulated per wall second on a 1P1D deployment (`pdserve bench-sim`).

Contract: one Poisson workload (prompt 512, output 128 tokens, ids format) is built once; the
timed part is `simulate` alone (the event loop plus `RequestRecord` construction) for a 1P1D
disaggregated deployment of a 13B-class model on A100s at ~70% prefill load, and for a constant
latency model; the benchmark's `summarize` is timed separately. Median of several runs, since the machine
may be shared. Single-threaded by construction.
"""

from __future__ import annotations

import statistics
import time

from pdserve.bench.lengths import fixed
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import load_hardware
from pdserve.latency.base import ConstantLatency
from pdserve.sim.requests import build_requests
from pdserve.latency.roofline import RooflineLatency
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.sim.transfer import LinkSpec


def bench_sim(num_requests: int = 50000, seed: int = 0, repeats: int = 3) -> dict:
    """Requests per wall second (median of `repeats` runs) for the roofline and constant 1P1D runs."""
    workload = WorkloadConfig(num_requests=num_requests, input_len=fixed(512), output_len=fixed(128), seed=seed,
                              prompt_style=PromptStyle(format="ids"))
    requests = build_requests(workload)
    roofline = RooflineLatency(load_model_spec("llama-13b-class"), load_hardware("a100-80g"))
    config = SimConfig(link=LinkSpec(25e9, "layer", roofline.model.geometry.layers))
    rate = 0.7 / roofline.prefill_s(512)
    out = {"num_requests": num_requests, "rate_rps": rate}
    for name, model in (("roofline", roofline), ("constant", ConstantLatency(prefill_ms=50, decode_step_ms=20))):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            result = simulate(requests, rate, config, model)
            times.append(time.perf_counter() - started)
        sim_s = statistics.median(times)
        started = time.perf_counter()
        summarize(result.records, Slo(1.0, 0.1))
        out[f"{name}_requests_per_s"] = num_requests / sim_s
        out[f"{name}_summarize_s"] = time.perf_counter() - started
        out[f"{name}_finished"] = result.num_finished
    return out
