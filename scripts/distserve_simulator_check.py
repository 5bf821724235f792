"""DistServe's own placement search (its simulator, fits and rules) on pdserve's workload lengths.

The check behind docs/planner.md's "DistServe's own simulator on this workload": it writes the
DistServe case's request lengths (pdserve's seeded lognormal draws, conditioned on OPT's 2,048
positions, as `pdserve plan` builds them) as DistServe's `sharegpt.ds`, then runs DistServe's
low-affinity search (`get_distserve_configs`, `run_binary_search`: one prefill + one decode
instance, per-phase P90, Poisson arrivals, N requests) over every configuration its A100 fits
and memory table cover, and prints each configuration's per-GPU goodput, best first.

Needs a checkout of LLMServe/DistServe (its `simdistserve` package) and `simpy` importable (e.g.
`pip install --target DIR simpy` and PYTHONPATH=DIR); pandas and numpy come with pdserve's venv.

Usage: python scripts/distserve_simulator_check.py DISTSERVE_CHECKOUT opt_13b 1 8 250 100
(model, nodes, GPUs a node, TTFT ms, TPOT ms; about 6 minutes of CPU for OPT-13B on one node)
"""

from __future__ import annotations

import argparse
import dataclasses
import marshal
import os
import sys
import tempfile
from pathlib import Path

from pdserve.cli import build_parser
from pdserve.commands.plan import plan_inputs
from pdserve.sim.requests import build_requests

LENGTHS = ["--hardware", "a100-80g", "--input-dist", "lognormal:6.3,0.8", "--output-dist", "lognormal:5.2,0.8"]


def write_dataset(model: str, path: Path, num: int = 4000) -> None:
    """pdserve's workload lengths for `model` as DistServe's marshal dataset at `path`."""
    args = build_parser().parse_args(["plan", "--model", model, "--gpus", "8", "--slo-ttft-ms", "1",
                                      "--slo-tpot-ms", "1", *LENGTHS])
    inputs = plan_inputs(args)
    workload = dataclasses.replace(inputs.workload, num_requests=num)
    requests = build_requests(workload, False, inputs.model.max_context)
    reqs = [("", p, o) for p, o in zip(requests.prompt_tokens, requests.output_tokens)]
    path.write_bytes(marshal.dumps({"dataset_name": "pdserve-lognormal", "reqs": reqs}))


def search(model: str, nodes: int, per_node: int, ttft_ms: str, tpot_ms: str, num: int) -> dict:
    """{config: per-GPU goodput} of DistServe's own search (imports its package lazily)."""
    from simdistserve.benchmarks.search_binary import run_binary_search
    from simdistserve.benchmarks.search_configs import get_distserve_configs
    from simdistserve.constants import ModelTypes
    from simdistserve.estimators.memory_estimator import is_model_runnable
    from simdistserve.estimators.time_estimator import distserve_profile_data

    kind = ModelTypes.model_str_to_object(model)
    fitted = {int(tp) for tp in distserve_profile_data[ModelTypes.formalize_model_name(kind)]}
    found = {}
    for c in get_distserve_configs(kind, nodes, per_node, False):
        cross, tp_p, pp_p, tp_d, pp_d = c
        if {tp_p, tp_d} <= fitted and is_model_runnable(kind, tp_p, cross * pp_p) and is_model_runnable(kind, tp_d, cross * pp_d):
            found[c] = run_binary_search(kind, c, "distserve", (ttft_ms, tpot_ms, 90, 90), max_per_gpu_rate=5,
                                         esp=0.25, N=num) or 0.0
            print(c, found[c], flush=True)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a LLMServe/DistServe checkout")
    ap.add_argument("model", choices=("opt_13b", "opt_66b", "opt_175b"))
    ap.add_argument("nodes", type=int)
    ap.add_argument("gpus_per_node", type=int)
    ap.add_argument("ttft_ms")
    ap.add_argument("tpot_ms")
    ap.add_argument("--num", type=int, default=300, help="requests per simulation (DistServe's README: 300)")
    a = ap.parse_args()
    data = Path(tempfile.mkdtemp())
    write_dataset(a.model.replace("_", "-"), data / "sharegpt.ds")
    os.environ["DATASET"] = str(data)
    sys.path.insert(0, a.checkout)
    found = search(a.model, a.nodes, a.gpus_per_node, a.ttft_ms, a.tpot_ms, a.num)
    ranked = sorted(found.items(), key=lambda kv: (-kv[1], kv[0][0] * (kv[0][1] * kv[0][2] + kv[0][3] * kv[0][4])))
    print("best (pp_cross, tp_prefill, pp_prefill, tp_decode, pp_decode):", ranked[:5])


if __name__ == "__main__":
    main()
