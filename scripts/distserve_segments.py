"""DistServe's chatbot cases under pdserve's search and under DistServe's two search assumptions.

DistServe's simulator search (LLMServe/DistServe `simdistserve/benchmarks/search_configs.py`,
`search_binary.py`, `base/worker.py`) differs from `pdserve plan` in three rules, each an
explicit option of the search here (not a default of the planner):

- one prefill and one decode instance per node segment, simulated end to end and replicated
  (`pdserve.search.segment_pairs`), where pdserve replicates each phase freely;
- a decode iteration holds at most 50,000 tokens of context per pipeline stage at every TP
  degree (`SearchSpace.decode_token_cap`, `candidates.DecodeTokenCap`), where pdserve sizes the
  batch by the K/V that fits;
- a free prefill instance takes every queued prompt into one iteration (`Worker._enter_prefill`,
  no batch limit; `SearchSpace.prefill_policy`), so each prompt's first token waits for the whole
  batch, where pdserve's prefill runs one prompt an iteration.

For one case this runs `pdserve plan` (the colocated plan and pdserve's disaggregated plan), then
the disaggregated search under combinations of the rules, on the same workload, SLOs,
attainment definition and step times, and prints one row per combination: the shapes, the
goodput per GPU, the gain over pdserve's colocated plan and whether prefill TP >= decode TP.

Usage: python scripts/distserve_segments.py opt-13b 8 250 100 [--definition phase]
(model, GPUs, TTFT ms, TPOT ms; A100 profile, ShareGPT-like lognormal lengths as in
docs/planner.md; about 1 / 1.5 / 3 minutes of CPU for OPT-13B / 66B / 175B)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from pdserve.cli import build_parser
from pdserve.commands.plan import plan_inputs
from pdserve.search import planner
from pdserve.search.candidates import WorkloadShape, parallel_shapes
from pdserve.search.phase_search import score_all
from pdserve.search.segment_pairs import best_pairs
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.requests import build_requests

DISTSERVE_DECODE_CAP = 50_000  # simdistserve/base/worker.py, `_enter_decodes`
BATCH_ALL = PrefillPolicy(max_batch=1_000_000)  # every queued prompt (`_enter_prefill`)
PAIR_RULES = (  # (row name, decode token cap, prefill policy) under the 1P+1D rule
    ("1P+1D per segment, K/V-sized decode", None, PrefillPolicy()),
    ("1P+1D per segment, 50k decode cap", DISTSERVE_DECODE_CAP, PrefillPolicy()),
    ("1P+1D, 50k cap, batched prefill (DistServe's three)", DISTSERVE_DECODE_CAP, BATCH_ALL),
)
WORKLOAD = ["--hardware", "a100-80g", "--input-dist", "lognormal:6.3,0.8", "--output-dist", "lognormal:5.2,0.8",
            "--margin", "0"]


def case_inputs(model: str, gpus: int, ttft_ms: float, tpot_ms: float, definition: str = "joint") -> planner.PlanInputs:
    """`pdserve plan` inputs of one DistServe chatbot case (docs/planner.md's command)."""
    args = build_parser().parse_args(["plan", "--model", model, "--gpus", str(gpus), "--slo-ttft-ms", str(ttft_ms),
                                      "--slo-tpot-ms", str(tpot_ms), "--definition", definition, *WORKLOAD])
    return plan_inputs(args)


def search_space(inputs: planner.PlanInputs, decode_token_cap: int | None = None,
                 prefill_policy: PrefillPolicy = PrefillPolicy()):
    """(space, shapes) as `pdserve plan` builds them, the decode cap and prefill policy as asked."""
    requests = build_requests(inputs.workload, inputs.prefix_cache, inputs.model.max_context)
    longer = planner._more_requests(inputs.workload, 8 * inputs.max_seqs, inputs.prefix_cache, inputs.model.max_context)
    space = dataclasses.replace(planner._space(inputs, requests, longer), decode_token_cap=decode_token_cap,
                                prefill_policy=prefill_policy)
    return space, parallel_shapes(inputs.model, inputs.hardware, inputs.gpus, WorkloadShape.of(requests))


def free_ratio_capped(inputs: planner.PlanInputs, result: planner.PlanResult):
    """pdserve's free-ratio plan (ledger goodput, no end-to-end run) with the decode cap."""
    space, shapes = search_space(inputs, DISTSERVE_DECODE_CAP)
    scores = dict(result.scores, decode=score_all(space, "decode", [(p, 0) for p in shapes], lambda _m: None))
    _, options = planner._build_plans(inputs, space.requests, scores)
    return planner._pick_disagg(options)


def row(name: str, p, d, n_p: int, n_d: int, per_gpu: float, colo_per_gpu: float) -> str:
    gain = per_gpu / colo_per_gpu - 1
    verdict = "disaggregate" if gain > 0 else "colocate"
    return (f"| {name} | {n_p}P {p.tp},{p.pp} + {n_d}D {d.tp},{d.pp} | {per_gpu:.3f} | {verdict}, {gain:+.1%} | "
            f"{'yes' if p.tp >= d.tp else 'no'} ({p.tp} vs {d.tp}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("gpus", type=int)
    ap.add_argument("ttft_ms", type=float)
    ap.add_argument("tpot_ms", type=float)
    ap.add_argument("--definition", choices=("joint", "phase"), default="joint")
    ap.add_argument("--top", type=int, default=4, help="pairs to list per rule")
    a = ap.parse_args()
    started = time.process_time()
    inputs = case_inputs(a.model, a.gpus, a.ttft_ms, a.tpot_ms, a.definition)
    result = planner.plan(inputs)
    colo, dis = result.colocated, result.disaggregated
    c = colo.goodput_per_gpu
    print(f"colocated: {colo.replicas} x {colo.score.label}, {c:.3f} req/s/GPU")
    print("| rules | shapes (P tp,pp / D tp,pp) | req/s/GPU | verdict vs colocated | prefill TP >= decode TP |")
    print("|---|---|---|---|---|")
    print(row("pdserve (free ratio, K/V-sized decode)", dis.prefill.par, dis.decode.par, dis.n_prefill, dis.n_decode,
              dis.goodput_per_gpu, c))
    capped = free_ratio_capped(inputs, result)
    print(row("free ratio, 50k decode cap (ledger)", capped.prefill.par, capped.decode.par, capped.n_prefill,
              capped.n_decode, capped.goodput_per_gpu, c))
    for name, cap, policy in PAIR_RULES:
        space, shapes = search_space(inputs, cap, policy)
        pairs = best_pairs(space, shapes, inputs.gpus)
        best = pairs[0]
        n = inputs.gpus // best.gpus
        print(row(name, best.prefill.par, best.decode.par, n, n, best.per_gpu, c))
        for pair in [q for q in pairs if q.status == "simulated"][:a.top]:
            print(f"    {pair.label}: {pair.goodput_rps:.3g} rps, {pair.per_gpu:.3f}/GPU (bound {pair.bound_rps:.3g})",
                  file=sys.stderr)
    print(f"({time.process_time() - started:.0f} s of CPU)", file=sys.stderr)


if __name__ == "__main__":
    main()
