"""DistServe's comparison with each engine's own step times: its placement on its engine's fits
against its vLLM 0.2 baseline on vLLM 0.2's fits, through pdserve's simulator and goodput.

DistServe's artifact (LLMServe/DistServe) profiled both engines on A100-80GB and fitted their
step times (`simdistserve/estimators/profile_data/profiler-a100-80g.{distserve,vllm}.json`);
`--latency-model distserve:ENGINE:CHECKOUT` (`pdserve.latency.distserve_fit`) reads them from a
checkout the user supplies. For one chatbot case (docs/planner.md's workload: A100, ShareGPT-like
lognormal lengths on OPT's 2,048 positions, seed 0, 400 requests, joint 90% attainment) this
prints, per GPU:

- DistServe's baseline: vLLM 0.2 colocated, prefill-first (no mixing), at DistServe's vLLM TP
  (PP1), on vLLM 0.2's fits, best over the chunk budgets (prompt batches) 2048 to 16384;
- DistServe's placement (its tuple) as one prefill + one decode instance simulated end to end on
  DistServe's fits, under pdserve's scheduling (one prompt an iteration, K/V-sized decode) and
  under DistServe's (every queued prompt in one iteration, 50k-token decode cap per stage);
- colocated on DistServe's fits (the same kernels as the disaggregated plans): prefill-first at
  vLLM's TP (the kernels alone), prefill-first at the best fitted TP, chunked prefill mixed with
  decode at the best TP (`pdserve plan`'s colocated candidates);
- `pdserve plan` on DistServe's fits: its colocated and disaggregated plans;

and the verdict of each disaggregated figure against vLLM 0.2 and against the best colocated
deployment on DistServe's fits (either scheduler, any fitted TP).

Usage: python scripts/distserve_fits_check.py DISTSERVE_CHECKOUT opt-13b 8 250 100 2,1,1,1 1
(checkout, model, GPUs for pdserve's search, TTFT ms, TPOT ms, DistServe's tuple tp_p,pp_p,tp_d,pp_d,
vLLM's TP; about 25 s of CPU for OPT-13B, 30 s for OPT-66B)
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pdserve.cli import build_parser
from pdserve.commands.plan import plan_inputs
from pdserve.search import planner
from pdserve.search.candidates import Parallel
from pdserve.search.phase_search import score_all
from pdserve.search.segment_pairs import score_pairs, segment_pairs
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.requests import build_requests

WORKLOAD = ["--hardware", "a100-80g", "--input-dist", "lognormal:6.3,0.8", "--output-dist", "lognormal:5.2,0.8",
            "--margin", "0"]
PROMPT_BUDGETS = (2048, 4096, 8192, 16384)  # prompt tokens a prefill-first iteration may batch
MIXED_BUDGETS = (256, 512, 1024, 2048)  # `pdserve plan`'s chunk budgets
DISTSERVE_RULES = (50_000, PrefillPolicy(max_batch=1_000_000))  # simdistserve/base/worker.py


def inputs_of(checkout: str, engine: str, a: argparse.Namespace, *extra: str) -> planner.PlanInputs:
    args = build_parser().parse_args(["plan", "--model", a.model, "--gpus", str(a.gpus), "--slo-ttft-ms", str(a.ttft_ms),
                                      "--slo-tpot-ms", str(a.tpot_ms), "--latency-model",
                                      f"distserve:{engine}:{checkout}", *WORKLOAD, *extra])
    return plan_inputs(args)


def space_of(inputs: planner.PlanInputs, cap: int | None = None, policy: PrefillPolicy = PrefillPolicy()):
    requests = build_requests(inputs.workload, inputs.prefix_cache, inputs.model.max_context)
    longer = planner._more_requests(inputs.workload, 8 * inputs.max_seqs, inputs.prefix_cache, inputs.model.max_context)
    return dataclasses.replace(planner._space(inputs, requests, longer), decode_token_cap=cap, prefill_policy=policy)


def colocated_best(inputs: planner.PlanInputs, tps: list[int], mixed: bool):
    """Best colocated score per GPU over TP `tps` (PP1) and the chunk budgets, prefill-first
    (whole prompts up to the budget, decodes waiting) or chunked prefill mixed with decode."""
    space = dataclasses.replace(space_of(inputs), mixed_batches=mixed)
    cands = [(Parallel(tp, 1), chunk) for tp in tps for chunk in (MIXED_BUDGETS if mixed else PROMPT_BUDGETS)]
    return score_all(space, "colocated", cands, lambda _m: None, prune=False)[0]


def distserve_pair(inputs: planner.PlanInputs, p: Parallel, d: Parallel, rules=(None, PrefillPolicy())):
    """DistServe's placement as one prefill + one decode instance, simulated end to end."""
    space = space_of(inputs, *rules)
    pre = score_all(space, "prefill", [(p, 0)], lambda _m: None, prune=False)
    dec = score_all(space, "decode", [(d, 0)], lambda _m: None, prune=False)
    pairs = segment_pairs(pre, dec, space.hardware.gpus_per_node, p.gpus + d.gpus)
    if not pairs:
        return None, pre[0], dec[0]
    return score_pairs(space, pairs[:1])[0], pre[0], dec[0]


def verdict(per_gpu: float, baseline: float) -> str:
    """The ratio and the verdict at margin 0 (DistServe keeps whichever is higher)."""
    gain = per_gpu / baseline - 1
    return f"{gain + 1:.2f}x, {gain:+.1%} ({'disaggregate' if gain > 0 else 'colocate'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a LLMServe/DistServe checkout (its simdistserve/estimators/profile_data)")
    ap.add_argument("model")
    ap.add_argument("gpus", type=int)
    ap.add_argument("ttft_ms", type=float)
    ap.add_argument("tpot_ms", type=float)
    ap.add_argument("placement", help="DistServe's tp_prefill,pp_prefill,tp_decode,pp_decode")
    ap.add_argument("vllm_tp", type=int, help="DistServe's vLLM baseline TP")
    a = ap.parse_args()
    started = time.process_time()
    tp_p, pp_p, tp_d, pp_d = (int(x) for x in a.placement.split(","))
    vllm = inputs_of(a.checkout, "vllm", a, "--colocated-scheduler", "prefill-first", "--chunk-budgets",
                     ",".join(map(str, PROMPT_BUDGETS)))
    base = colocated_best(vllm, [a.vllm_tp], mixed=False)
    print(f"vLLM 0.2 baseline, prefill-first TP{a.vllm_tp} on vLLM's fits: {base.per_gpu:.3f} req/s/GPU "
          f"(chunk {base.chunk_tokens})")
    ds = inputs_of(a.checkout, "distserve", a)
    fitted = sorted({tp for tp in range(1, 9) if ds.family(tp, 1).fit is not None})
    ladder = {}
    for name, tps, mixed in ((f"prefill-first TP{a.vllm_tp}", [a.vllm_tp], False),
                             ("prefill-first, best TP", fitted, False), ("chunked mixed, best TP", fitted, True)):
        ladder[name] = colocated_best(ds, tps, mixed)
        print(f"colocated on DistServe's fits, {name}: {ladder[name].label} {ladder[name].per_gpu:.3f} req/s/GPU")
    result = planner.plan(ds)  # its colocated candidates are the chunked mixed ones
    colo, dis = result.colocated, result.disaggregated
    c = max(colo.goodput_per_gpu, ladder["prefill-first, best TP"].per_gpu)
    print(f"`pdserve plan` on DistServe's fits, colocated: {colo.replicas} x {colo.score.label}: "
          f"{colo.goodput_per_gpu:.3f} req/s/GPU; best colocated (either scheduler): {c:.3f}")
    print(f"`pdserve plan` on DistServe's fits, disaggregated: {dis.n_prefill}P {dis.prefill.par} + {dis.n_decode}D "
          f"{dis.decode.par} ({dis.affinity}): {dis.goodput_per_gpu:.3f} req/s/GPU; vs vLLM "
          f"{verdict(dis.goodput_per_gpu, base.per_gpu)}, vs best colocated {verdict(dis.goodput_per_gpu, c)}")
    print("| placement | scheduling | prefill alone | decode alone | pair, req/s/GPU | vs vLLM 0.2 | vs best colocated |")
    print("|---|---|---|---|---|---|---|")
    for name, rules in (("pdserve's", (None, PrefillPolicy())), ("DistServe's", DISTSERVE_RULES)):
        pair, pre, dec = distserve_pair(ds, Parallel(tp_p, pp_p), Parallel(tp_d, pp_d), rules)
        got = pair.per_gpu if pair else 0.0
        print(f"| P {Parallel(tp_p, pp_p)} + D {Parallel(tp_d, pp_d)} | {name} | {pre.goodput_rps:.2f} rps | "
              f"{dec.goodput_rps:.2f} rps | {got:.3f} | {verdict(got, base.per_gpu)} | {verdict(got, c)} |")
    print(f"({time.process_time() - started:.0f} s of CPU)")


if __name__ == "__main__":
    main()
