"""DistServe's placement rule against pdserve's, on pdserve's own per-shape goodputs.

DistServe's simulator search (LLMServe/DistServe `simdistserve/benchmarks/search_configs.py` and
`simulate_dist.py`) scores each low-affinity configuration as ONE prefill instance beside ONE
decode instance in a node segment (`DisaggCluster` with one instance of each), at
rate / (GPUs of both); pdserve replicates each phase freely (n_p : n_d). This script simulates
every prefill and decode shape that fits one 8-GPU segment (no pruning, same workload and SLOs
as `pdserve plan`), then ranks the pairs both ways:

- DistServe 1:1: min(g_p, g_d) / (gpus_p + gpus_d), both within `--segment-gpus`;
- pdserve's ratio: the best per-GPU goodput of each phase alone.

Usage: python scripts/distserve_segments.py opt-13b 250 100   (model, TTFT ms, TPOT ms; A100,
ShareGPT-like lognormal lengths as in docs/planner.md; about a minute of CPU for OPT-66B)
"""

from __future__ import annotations

import argparse

from pdserve.cli import build_parser
from pdserve.commands.plan import plan_inputs
from pdserve.search import planner
from pdserve.search.candidates import WorkloadShape, parallel_shapes
from pdserve.search.phase_search import _bound, _runner
from pdserve.sim.goodput import goodput_rps, ladder_around


def phase_goodputs(model: str, ttft_ms: str, tpot_ms: str, segment_gpus: int) -> dict[tuple[str, str], tuple[float, int]]:
    """(phase, shape) -> (simulated goodput rps, GPUs) for every shape below one segment."""
    args = build_parser().parse_args([
        "plan", "--model", model, "--hardware", "a100-80g", "--gpus", str(segment_gpus),
        "--input-dist", "lognormal:6.3,0.8", "--output-dist", "lognormal:5.2,0.8",
        "--slo-ttft-ms", ttft_ms, "--slo-tpot-ms", tpot_ms])
    inputs = plan_inputs(args)
    requests = planner.build_requests(inputs.workload, inputs.prefix_cache, inputs.model.max_context)
    longer = planner._more_requests(inputs.workload, 8 * inputs.max_seqs, inputs.prefix_cache, inputs.model.max_context)
    space = planner._space(inputs, requests, longer)
    shapes = [p for p in parallel_shapes(inputs.model, inputs.hardware, segment_gpus - 1, WorkloadShape.of(requests))]
    out = {}
    for phase in ("prefill", "decode"):
        for par in shapes:
            cap, estimate = _bound(space, phase, (par, 0))
            rate = 0.0 if cap <= 0 else goodput_rps(_runner(space, phase, par, 0), space.slo, ladder_around(estimate),
                                                   space.definition).rate
            out[phase, str(par)] = (rate, par.gpus)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("ttft_ms")
    ap.add_argument("tpot_ms")
    ap.add_argument("--segment-gpus", type=int, default=8)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    got = phase_goodputs(a.model, a.ttft_ms, a.tpot_ms, a.segment_gpus)
    for phase in ("prefill", "decode"):
        rows = sorted(((g / n, s, g) for (ph, s), (g, n) in got.items() if ph == phase), reverse=True)
        print(f"{phase}: " + ", ".join(f"{s} {g:.2f} ({per:.2f}/GPU)" for per, s, g in rows))
    pairs = []
    for (ph_p, p), (g_p, n_p) in got.items():
        for (ph_d, d), (g_d, n_d) in got.items():
            if ph_p == "prefill" and ph_d == "decode" and n_p + n_d <= a.segment_gpus:
                pairs.append((min(g_p, g_d) / (n_p + n_d), p, d, n_p + n_d))
    print("DistServe 1:1 segments, best first:")
    for per, p, d, n in sorted(pairs, reverse=True)[:a.top]:
        print(f"  P {p} + D {d} on {n} GPUs: {per:.3f} req/s/GPU")


if __name__ == "__main__":
    main()
