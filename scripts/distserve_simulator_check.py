"""DistServe's own placement search (its simulator, fits and rules) on pdserve's workload lengths.

The check behind docs/planner_agreement.md's "DistServe's own simulator on this workload": it writes the
DistServe case's request lengths (pdserve's seeded lognormal draws, conditioned on OPT's 2,048
positions, as `pdserve plan` builds them) as DistServe's `sharegpt.ds`, then runs DistServe's
low-affinity search (`get_distserve_configs`, `run_binary_search`: one prefill + one decode
instance, per-phase P90, Poisson arrivals, N requests) over every configuration its A100 fits
and memory table cover, and prints each configuration's per-GPU goodput, best first.

Needs a checkout of LLMServe/DistServe (its `simdistserve` package) and `simpy` importable (e.g.
`pip install --target DIR simpy` and PYTHONPATH=DIR); pandas and numpy come with pdserve's venv.

Usage: python scripts/distserve_simulator_check.py DISTSERVE_CHECKOUT opt_13b 1 8 250 100
(model, nodes, GPUs a node, TTFT ms, TPOT ms; about 6 minutes of CPU for OPT-13B on one node)

With `--one PP_CROSS,TP_P,PP_P,TP_D,PP_D --per-gpu-rate R` it runs DistServe's simulator once for
that configuration instead (a few seconds) and prints what its decode side holds: P90 TTFT and
TPOT, the most tokens in one decode iteration (its 50,000-token cap per stage), and the most
requests decoding at once with their context tokens, i.e. the K/V the instance would have to
keep (the simulator checks no memory: requests past the cap wait in the decode queue, K/V and
all, and take turns with the batch).
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

A100_BYTES = 80e9
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


def one_run(model: str, config: str, per_gpu_rate: float, ttft_ms: str, tpot_ms: str, num: int, checkout: str) -> None:
    """One run of DistServe's simulator for `config`; prints its latencies and decode occupancy."""
    from simdistserve.benchmarks.simulate_dist import parse_args, run_experiment
    from simdistserve.constants import ModelTypes

    cross, tp_p, pp_p, tp_d, pp_d = (int(x) for x in config.split(","))
    gpus = cross * (tp_p * pp_p + tp_d * pp_d)
    worker_csv = Path(tempfile.mkdtemp()) / "workers.csv"
    args = parse_args([str(x) for x in (
        "--arrival", "poisson", "--seed", 0, "--N", num, "--prefill-containment", 90, "--prefill-target", ttft_ms,
        "--decode-containment", 90, "--decode-target", tpot_ms, "--model",
        ModelTypes.formalize_model_name(ModelTypes.model_str_to_object(model)), "--workload", "sharegpt",
        "--slas", "[]", "--slo-scales", "[1]", "--backend", "distserve", "--tp-prefill", tp_p,
        "--pp-prefill", cross * pp_p, "--tp-decode", tp_d, "--pp-decode", cross * pp_d,
        "--rate", per_gpu_rate * gpus, "--output-worker", worker_csv)])
    outputs: dict = {}
    ok_p, ok_d, _ = run_experiment(args, outputs)
    lat, events = outputs["per_request_latency_df"], outputs["request_event_df"]
    decodes = outputs["worker_df"].query("event_type == 'do_decode'")
    tokens = decodes.decode_batch.map(lambda b: sum(eval(b) if isinstance(b, str) else b) + len(eval(b) if isinstance(b, str) else b))
    start = events[events.event_type == "wait_decode"].groupby("req_id").start_time.min()
    end = events[events.event_type == "exit_system"].groupby("req_id").end_time.max()
    reqs = outputs["request_df"].set_index("req_id")
    peak, peak_tokens = 0, 0
    for t in sorted(start):  # occupancy changes upward only at a decode start
        live = (start <= t) & (end > t)
        if live.sum() > peak:
            done = ((t - start[live]) / lat.tpot[live]).clip(lower=0)  # tokens each has decoded by t, roughly
            peak, peak_tokens = int(live.sum()), int((reqs.prefill_lens[live] + done).sum())
    print(f"{config} at {per_gpu_rate} req/s/GPU ({per_gpu_rate * gpus:.2f} rps, {num} requests): "
          f"P90 TTFT {lat.first_token_latency.quantile(0.9):.0f} ms ({'ok' if ok_p else 'miss'}), "
          f"P90 TPOT {lat.tpot.quantile(0.9):.1f} ms ({'ok' if ok_d else 'miss'}); decode iterations: "
          f"{len(decodes)}, most tokens in one {tokens.max()}, median batch {decodes.decode_bs.median():.0f}; "
          f"most requests decoding at once {peak} holding ~{peak_tokens} tokens of K/V")
    steady_state_kv(model, reqs, per_gpu_rate * gpus, float(tpot_ms), (tp_d, cross * pp_d), checkout)


def steady_state_kv(model: str, reqs, rate: float, tpot_ms: float, decode: tuple[int, int], checkout: str) -> None:
    """First principles (Little's law): the sequences decoding at once when every request runs at
    the TPOT target, their K/V, and what the decode GPUs hold after the weights; then the decode
    instance's best token rate on DistServe's own fits with its batch at its K/V capacity."""
    from pdserve.latency.distserve_fit import DistServeSpec, distserve_family
    from pdserve.latency.geometry import load_model_spec

    spec = load_model_spec(model.replace("_", "-"))
    decode_gpus = decode[0] * decode[1]
    p, o = reqs.prefill_lens.astype(float), reqs.output_lens.astype(float)
    context = (o * (p + (o + 1) / 2)).sum() / o.sum()  # a decoding sequence's length, averaged over its steps
    seqs = rate * o.mean() * tpot_ms / 1e3
    free = decode_gpus * A100_BYTES - spec.total_weight_bytes
    print(f"steady state at {rate:.2f} rps and TPOT {tpot_ms:.0f} ms: {seqs:.0f} sequences decoding x {context:.0f} "
          f"tokens = {seqs * context / 1e3:.0f}k tokens, {seqs * context * spec.kv_bytes_per_token / 1e9:.0f} GB of K/V "
          f"({spec.kv_bytes_per_token / 1e6:.2f} MB a token); {decode_gpus} x A100-80GB hold {free / 1e9:.0f} GB after "
          f"the weights ({free / spec.kv_bytes_per_token / 1e3:.0f}k tokens)")
    fit = distserve_family(DistServeSpec("distserve", checkout), spec)(*decode)
    batch = int(fit.kv_capacity_tokens // context)
    step = fit.decode_step_s(batch, int(batch * context))
    print(f"DistServe's fit, decode tp{decode[0]}pp{decode[1]} at its K/V capacity ({fit.kv_capacity_tokens} tokens: "
          f"{batch} sequences): a token every {step * 1e3:.0f} ms each, {batch / step:.0f} tokens/s = "
          f"{batch / step / o.mean():.2f} rps at most, against {rate:.2f} rps offered")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a LLMServe/DistServe checkout")
    ap.add_argument("model", choices=("opt_13b", "opt_66b", "opt_175b"))
    ap.add_argument("nodes", type=int)
    ap.add_argument("gpus_per_node", type=int)
    ap.add_argument("ttft_ms")
    ap.add_argument("tpot_ms")
    ap.add_argument("--num", type=int, default=300, help="requests per simulation (DistServe's README: 300)")
    ap.add_argument("--one", metavar="PP_CROSS,TP_P,PP_P,TP_D,PP_D", help="one simulation of this configuration")
    ap.add_argument("--per-gpu-rate", type=float, default=1.0, help="with --one: the arrival rate per GPU")
    a = ap.parse_args()
    data = Path(tempfile.mkdtemp())
    write_dataset(a.model.replace("_", "-"), data / "sharegpt.ds")
    os.environ["DATASET"] = str(data)
    sys.path.insert(0, a.checkout)
    if a.one:
        one_run(a.model, a.one, a.per_gpu_rate, a.ttft_ms, a.tpot_ms, a.num, a.checkout)
        return
    found = search(a.model, a.nodes, a.gpus_per_node, a.ttft_ms, a.tpot_ms, a.num)
    ranked = sorted(found.items(), key=lambda kv: (-kv[1], kv[0][0] * (kv[0][1] * kv[0][2] + kv[0][3] * kv[0][4])))
    print("best (pp_cross, tp_prefill, pp_prefill, tp_decode, pp_decode):", ranked[:5])


if __name__ == "__main__":
    main()
