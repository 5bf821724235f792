"""The placement planner: colocate or disaggregate, with which parallelism and how many replicas.

Contract: `plan(inputs)` scores every colocated (TP x PP x chunk budget), prefill and decode
candidate (`phase_search.py`), builds the best colocated, high-affinity and low-affinity
deployments (`plans.py`), re-simulates the winners end to end (with K/V transfer) for their
system goodput, and computes the net margin dT (ledger `net_margin_s`) at matched load.
`decision.decide` is the one rule (goodput per GPU beyond `margin`, K/V feasibility first); it
names the test that decided and reports dT beside it. The runner-up is the best plan of the
other kind.

The end-to-end figure of the disaggregated plan (`EndToEnd.rate`) is held to the rate the deployment
sustains (`end_to_end_cap`), as each instance's score is (`phase_search.py`): the run is finite, and
past that rate it passes where the growing queue's wait fits a loose TTFT or spreads over every output
token inside a loose TPOT (1P + 1D held by a 40 rps decode passed 2,164 rps). Handing every request
off, that rate is the ledger's system goodput of the two pools' capacities (`plans.sustained_rps`);
routed by margin, the decode pool's alone, since a request prefilled on its decode worker skips the
prefill pool. The colocated figure is not held, as its instance score is not.

P/D routing (`pd_decision`, issue 20): "always" hands every request of the disaggregated plan
off, as above. "margin" (the default, as `pdserve serve` runs a disaggregated deployment) models
what the served router does when the latency model is a `pdserve profile` fit (the only one
`pdserve serve --pd-profile` prices with; otherwise the plan falls back to "always" and says so):
every simulation of the disaggregated plan routes each request by the router's own decision
(search/margin_routing.py over sim/margin_routed.py), and the verdict weighs the two plans'
end-to-end goodput per GPU (the colocated one simulated alike), since the phase scores cannot
see a request prefilled on its decode worker. The result keeps the decisions at the matched load
(`routed`) and the share of requests kept local at the disaggregated plan's goodput.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from statistics import fmean, median
from typing import Callable

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.lengths import fixed
from pdserve.bench.metrics import Slo
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig
from pdserve.ledger.margin import MarginTerms, net_margin_s
from pdserve.search.decision import Verdict, decide
from pdserve.search.candidates import DecodeTokenCap, Parallel, WorkloadShape, latency_for, parallel_shapes
from pdserve.latency.geometry import ModelSpec
from pdserve.sim.goodput import GoodputSearch, goodput_rps, ladder_around
from pdserve.latency.hardware import HardwareProfile
from pdserve.latency.base import LatencyModel
from pdserve.latency.spec import LatencyFamily
from pdserve.search.phase_search import Score, SearchSpace, score_all
from pdserve.search.plans import ColocatedPlan, DisaggPlan, colocated_plan, high_affinity_plan, low_affinity_plan
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.requests import SimRequests, build_requests
from pdserve.sim.simulator import SimConfig, SimResult, simulate
from pdserve.search.margin_routing import MarginRouter, RoutedDecision, served_pricing
from pdserve.sim.transfer import LinkSpec

CHUNK_BUDGETS = (256, 512, 1024, 2048)
MARGIN_LOAD = 0.8
PD_DECISIONS = ("always", "margin")


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on. `link_bytes_per_s` overrides the per-GPU inter-node NIC."""

    model: ModelSpec
    hardware: HardwareProfile
    gpus: int
    workload: WorkloadConfig
    slo: Slo
    target_rps: float | None = None
    link_bytes_per_s: float | None = None
    chunk_budgets: tuple[int, ...] = CHUNK_BUDGETS
    definition: str = "joint"
    margin: float = 0.1
    max_seqs: int = 256
    transfer_overlap: str = "layer"
    route_delta_s: float = 0.0
    failure_penalty_s: float = 0.0
    fixed_model: LatencyModel | None = None  # e.g. a `pdserve profile` fit: single-GPU shapes only
    family: LatencyFamily | None = None  # a latency model per TP x PP shape (aic:...); None: the roofline
    latency_label: str = "roofline"  # what timed the steps, for the report
    prefix_cache: bool = False  # shared prefixes and earlier turns count as cache hits (`--prefix-cache`)
    mixed_batches: bool = True  # colocated scheduler: chunked prefill mixed with decode; False: prefill-first, unmixed
    pd_decision: str = "margin"  # the disaggregated plan's per-request routing (module contract)
    pd_chunk_tokens: int = 512  # the served engine's step budget, which the router's decision prices with
    # DistServe's search rules, off by default (docs/planner_agreement.md, DistServe): a decode batch held to
    # this many tokens of context per pipeline stage, and prompts a prefill instance runs per iteration
    decode_token_cap: int | None = None
    prefill_max_batch: int = 1

    def __post_init__(self) -> None:
        if self.pd_decision not in PD_DECISIONS:
            raise ValueError(f"--pd-decision must be one of {PD_DECISIONS}, got {self.pd_decision!r}")
        if self.decode_token_cap is not None and self.decode_token_cap < 1:
            raise ValueError(f"--decode-token-cap must be >= 1 token, got {self.decode_token_cap}")
        if self.prefill_max_batch < 1:
            raise ValueError(f"--prefill-batch must be >= 1 prompt, got {self.prefill_max_batch}")
        if self.prefill_max_batch > 1 and self.pd_modelled == "margin":
            raise ValueError("--prefill-batch > 1 is simulated with --pd-decision always only: the margin-routed "
                             "simulation runs one prompt per prefill iteration, as the served prefill worker does")

    @property
    def prefill_policy(self) -> PrefillPolicy:
        return PrefillPolicy(max_batch=self.prefill_max_batch)

    @property
    def pd_modelled(self) -> str:
        """The routing the plan simulates: "margin" needs a profiled latency model (module contract)."""
        profiled = self.fixed_model is not None and self.fixed_model.to_dict().get("kind") == "profiled"
        return "margin" if self.pd_decision == "margin" and profiled else "always"


@dataclass(frozen=True)
class EndToEnd:
    """A planned deployment simulated whole: the finite run's goodput search and the sustained rate
    its figure is held to (None: not held; module contract)."""

    search: GoodputSearch
    sustained_rps: float | None = None

    @property
    def rate(self) -> float:
        """The end-to-end goodput: the run's, at most the sustained rate."""
        return self.search.rate if self.sustained_rps is None else min(self.search.rate, self.sustained_rps)

    @property
    def held(self) -> bool:
        """Whether the finite run passed above the sustained rate."""
        return self.rate < self.search.rate

    @property
    def points(self):
        return self.search.points


@dataclass(frozen=True)
class PlanResult:
    decision: str
    colocated: ColocatedPlan | None
    disaggregated: DisaggPlan | None
    alternatives: tuple[DisaggPlan, ...]
    scores: dict[str, list[Score]]
    end_to_end: dict[str, EndToEnd]
    margin: MarginTerms | None
    elapsed_s: float
    inputs: PlanInputs = field(repr=False)
    verdict: Verdict | None = None
    routed: tuple[RoutedDecision, ...] = field(default=(), repr=False)  # margin: decisions at the matched load
    local_share: float | None = None  # margin: requests kept local at the disaggregated plan's end-to-end goodput

    @property
    def pd_decision(self) -> str:
        return self.inputs.pd_modelled

    @property
    def net_margin_s(self) -> float | None:
        return None if self.margin is None else net_margin_s(self.margin)

    @property
    def num_candidates(self) -> int:
        return sum(len(v) for v in self.scores.values())


def plan(inputs: PlanInputs, progress: Callable[[str], None] = lambda _msg: None) -> PlanResult:
    """Search, combine, verify end to end and decide (see the module contract)."""
    started = time.perf_counter()
    requests = build_requests(inputs.workload, inputs.prefix_cache, inputs.model.max_context)
    decode_requests = _more_requests(inputs.workload, 8 * inputs.max_seqs, inputs.prefix_cache, inputs.model.max_context)
    space = _space(inputs, requests, decode_requests)
    shapes = [Parallel(1, 1)] if inputs.fixed_model else parallel_shapes(inputs.model, inputs.hardware, inputs.gpus, WorkloadShape.of(requests),
                                                                      inputs.family)
    if not shapes:
        raise ValueError(f"{inputs.model.name} does not fit on {inputs.gpus} x {inputs.hardware.name} with this workload")
    scores = {
        "colocated": score_all(space, "colocated", [(p, c) for p in shapes for c in inputs.chunk_budgets], progress),
        "prefill": score_all(space, "prefill", [(p, 0) for p in shapes], progress),
        "decode": score_all(space, "decode", [(p, 0) for p in shapes], progress),
    }
    colo, options = _build_plans(inputs, requests, scores)
    disagg = _pick_disagg(options)
    end_to_end = _verify(inputs, colo, disagg, progress)
    margin, routed = _margin(inputs, colo, disagg) if colo and disagg else (None, ())
    per_gpu = _per_gpu(inputs, colo, end_to_end, "colocated"), _per_gpu(inputs, disagg, end_to_end, "disaggregated")
    verdict = decide(*per_gpu, bool(disagg and disagg.link_ok), inputs.margin, margin)
    share = _local_share(inputs, disagg, end_to_end) if inputs.pd_modelled == "margin" else None
    return PlanResult(verdict.decision, colo, disagg, tuple(options), scores, end_to_end, margin,
                      time.perf_counter() - started, inputs, verdict, routed, share)


def counted_gpus(inputs: PlanInputs, plan_: ColocatedPlan | DisaggPlan) -> int:
    """The GPUs a plan's goodput is divided by for the verdict: with a budget (no target rate) every
    GPU of the budget, idle ones included (a P:D split that leaves 2 of 16 GPUs out still costs 16,
    as aiconfigurator counts its cluster); with a target rate the plan's own."""
    return plan_.gpus if inputs.target_rps else max(inputs.gpus, plan_.gpus)


def _per_gpu(inputs: PlanInputs, plan_, end_to_end: dict[str, EndToEnd], name: str) -> float | None:
    """A plan's goodput per counted GPU for the verdict: its planned one, or end to end under margin routing."""
    if plan_ is None:
        return None
    if inputs.pd_modelled == "always":
        return plan_.goodput_rps / counted_gpus(inputs, plan_)
    found = end_to_end.get(name)
    return found.rate / counted_gpus(inputs, plan_) if found else 0.0


def _local_share(inputs: PlanInputs, disagg: DisaggPlan | None, end_to_end: dict[str, EndToEnd]) -> float | None:
    """Share of routed requests the disaggregated plan prefilled on their decode worker, at its goodput."""
    found = end_to_end.get("disaggregated")
    if disagg is None or found is None or found.rate <= 0:
        return None
    config, _, _ = deployment(inputs, disagg)
    result, _ = run_deployment(inputs, disagg, _e2e_requests(inputs, config), found.rate)
    return len(result.local_requests) / max(1, result.num_arrived - result.num_rejected)


def _space(inputs: PlanInputs, requests: SimRequests, decode_requests: SimRequests) -> SearchSpace:
    return SearchSpace(inputs.model, inputs.hardware, requests, decode_requests, inputs.slo, inputs.definition,
                       inputs.max_seqs, inputs.prefill_policy, fixed_model=inputs.fixed_model, family=inputs.family,
                       mixed_batches=inputs.mixed_batches, decode_token_cap=inputs.decode_token_cap)


def _latency(inputs: PlanInputs, par: Parallel) -> LatencyModel:
    return inputs.fixed_model or latency_for(inputs.model, inputs.hardware, par, inputs.family)


def _build_plans(inputs: PlanInputs, requests: SimRequests, scores) -> tuple[ColocatedPlan | None, list[DisaggPlan]]:
    hw, weights = inputs.hardware, inputs.model.total_weight_bytes
    kv_per_request = WorkloadShape.of(requests).mean_prompt * inputs.model.kv_bytes_per_token
    nic = inputs.link_bytes_per_s or hw.internode_bytes_per_s
    pre, dec, target = scores["prefill"], scores["decode"], inputs.target_rps
    colo = colocated_plan(scores["colocated"], inputs.gpus, target, weights)
    options = [
        high_affinity_plan(pre, dec, inputs.gpus, target, kv_per_request, nic, weights),
        low_affinity_plan(pre, dec, inputs.gpus, target, hw.gpus_per_node, kv_per_request, hw.nvlink_send_bytes_per_s, weights),
    ]
    return colo, [p for p in options if p is not None]


def _pick_disagg(options: list[DisaggPlan]) -> DisaggPlan | None:
    """Best goodput per GPU among K/V-feasible plans (an infeasible one only if nothing else)."""
    return max(options, key=lambda p: (p.link_ok, p.goodput_per_gpu, -p.gpus), default=None)


def deployment(inputs: PlanInputs, plan_: ColocatedPlan | DisaggPlan):
    """(SimConfig, prefill model, decode model) simulating a whole planned deployment."""
    if isinstance(plan_, ColocatedPlan):
        model = _latency(inputs, plan_.score.par)
        config = SimConfig(mode="colocated", replicas=plan_.replicas, chunk_tokens=plan_.score.chunk_tokens,
                           max_decode_seqs=inputs.max_seqs, mixed_batches=inputs.mixed_batches)
        return config, model, model
    link = LinkSpec(plan_.decode.par.gpus * plan_.link_bytes_per_s_per_gpu, inputs.transfer_overlap, inputs.model.geometry.layers)
    config = SimConfig(mode="disaggregated", prefill_replicas=plan_.n_prefill, decode_replicas=plan_.n_decode,
                       prefill=inputs.prefill_policy, max_decode_seqs=inputs.max_seqs, link=link)
    decode = _latency(inputs, plan_.decode.par)
    if inputs.decode_token_cap is not None:
        decode = DecodeTokenCap(decode, inputs.decode_token_cap)
    return config, _latency(inputs, plan_.prefill.par), decode


def margin_router(inputs: PlanInputs) -> MarginRouter | None:
    """A fresh router decision for one simulation of the disaggregated plan (None: "always")."""
    if inputs.pd_modelled != "margin":
        return None
    cost, policy = served_pricing(inputs.model, inputs.fixed_model.to_dict(), inputs.pd_chunk_tokens)
    return MarginRouter(cost, policy, inputs.slo.ttft_s, inputs.slo.tpot_s,
                        same_host=inputs.gpus <= inputs.hardware.gpus_per_node)


def run_deployment(inputs: PlanInputs, plan_: ColocatedPlan | DisaggPlan, requests: SimRequests,
                   rate: float | None) -> tuple[SimResult, MarginRouter | None]:
    """Simulate a planned deployment, routed as the plan models it; the router, to read its decisions."""
    config, pm, dm = deployment(inputs, plan_)
    router = margin_router(inputs) if config.mode == "disaggregated" else None
    return simulate(requests, rate, config, pm, dm, router), router


def _more_requests(workload: WorkloadConfig, at_least: int, prefix_cache: bool = False,
                   max_context: int | None = None) -> SimRequests:
    """The workload grown to `at_least` requests (a trace is used as it is), within the model's
    context window."""
    if workload.trace_path is None and workload.num_requests < at_least:
        workload = dataclasses.replace(workload, num_requests=at_least)
    return build_requests(workload, prefix_cache, max_context)


def _e2e_requests(inputs: PlanInputs, config: SimConfig) -> SimRequests:
    """Enough requests that every instance, and every decode batch, sees a useful sample."""
    decode_instances = config.replicas if config.mode == "colocated" else config.decode_replicas
    return _more_requests(inputs.workload, max(100 * config.instances, 8 * inputs.max_seqs * decode_instances),
                          inputs.prefix_cache, inputs.model.max_context)


def end_to_end_cap(inputs: PlanInputs, plan_: ColocatedPlan | DisaggPlan) -> float | None:
    """The rate a planned deployment sustains, which its end-to-end figure is held to (module
    contract): disaggregated, both pools' (`DisaggPlan.sustained_rps`), or the decode pool's alone
    when routed by margin; colocated, None."""
    if isinstance(plan_, ColocatedPlan):
        return None
    return plan_.decode_capacity_rps if inputs.pd_modelled == "margin" else plan_.sustained_rps


def _verify(inputs: PlanInputs, colo, disagg, progress) -> dict[str, EndToEnd]:
    """Simulated goodput of each chosen deployment, transfers and routing included, held to the
    rate it sustains."""
    found = {}
    for name, plan_ in (("colocated", colo), ("disaggregated", disagg)):
        if plan_ is None or plan_.goodput_rps <= 0:
            continue
        config, _, _ = deployment(inputs, plan_)
        requests = _e2e_requests(inputs, config)
        run = lambda rate, p=plan_, r=requests: run_deployment(inputs, p, r, rate)[0].records  # noqa: E731
        search = goodput_rps(run, inputs.slo, ladder_around(plan_.goodput_rps, 1.5), inputs.definition)
        found[name] = EndToEnd(search, end_to_end_cap(inputs, plan_))
        held = f", the run {search.rate:.3g} held to the sustained rate" if found[name].held else ""
        progress(f"end-to-end {name}: {found[name].rate:.3g} rps (ledger {plan_.goodput_rps:.3g}{held})")
    return found


def bench_sample(inputs: PlanInputs, num_requests: int) -> SimRequests:
    """The first `num_requests` requests of the workload (a trace as it is): what a benchmark of
    that size with the same seed replays."""
    workload = inputs.workload
    if workload.trace_path is None:
        workload = dataclasses.replace(workload, num_requests=num_requests)
    return build_requests(workload, inputs.prefix_cache)


def sample_goodput(inputs: PlanInputs, plan_: ColocatedPlan | DisaggPlan, num_requests: int) -> GoodputSearch:
    """Simulated goodput of a planned deployment on exactly the first `num_requests` requests of
    the workload (same seed, so the same lengths and unit arrivals a benchmark of that size
    replays): the figure a short measurement of the live system is held to."""
    requests = bench_sample(inputs, num_requests)
    run = lambda rate: run_deployment(inputs, plan_, requests, rate)[0].records  # noqa: E731
    return goodput_rps(run, inputs.slo, ladder_around(plan_.goodput_rps, 1.5), inputs.definition, rel_tol=0.01)


def load_clocks(inputs: PlanInputs, plan_: ColocatedPlan | DisaggPlan, num_requests: int, rate: float,
                seed: int) -> list:
    """Simulated records of `num_requests` of the workload on `seed` at `rate` on the planned
    deployment (what a load calibration through the live server is compared with, request by
    request)."""
    workload = dataclasses.replace(inputs.workload, seed=seed)
    if workload.trace_path is None:
        workload = dataclasses.replace(workload, num_requests=num_requests)
    return run_deployment(inputs, plan_, build_requests(workload, inputs.prefix_cache), rate)[0].records


def burst_clocks(inputs: PlanInputs, plan_: ColocatedPlan | DisaggPlan, prompt_tokens: int, output_tokens: int,
                 burst: int, rate: float) -> tuple[float, float]:
    """Median simulated (TTFT s, TPOT s) of `burst` equal requests arriving at `rate` on the
    planned deployment (what a calibration burst through the live server is compared with)."""
    workload = WorkloadConfig(num_requests=burst, input_len=fixed(prompt_tokens), output_len=fixed(output_tokens),
                              arrival=ArrivalSpec("constant"), prompt_style=PromptStyle(format="ids"))
    records = run_deployment(inputs, plan_, build_requests(workload), rate)[0].records
    return median(r.ttft_s for r in records), median(r.tpot_s for r in records)


def _margin(inputs: PlanInputs, colo: ColocatedPlan, disagg: DisaggPlan) -> tuple[MarginTerms, tuple[RoutedDecision, ...]]:
    """dT terms at matched offered load: 80% of the smaller planned goodput (both plans in SLO);
    and, routing by margin, the disaggregated plan's decisions there."""
    rate = MARGIN_LOAD * (min(colo.goodput_rps, disagg.goodput_rps) or max(colo.goodput_rps, disagg.goodput_rps))
    colo_cfg, pm, _ = deployment(inputs, colo)
    colo_e2e = fmean(r.e2e_s for r in simulate(_e2e_requests(inputs, colo_cfg), rate, colo_cfg, pm).records if r.success)
    dis_cfg, _, _ = deployment(inputs, disagg)
    result, router = run_deployment(inputs, disagg, _e2e_requests(inputs, dis_cfg), rate)
    dis_e2e = fmean(r.e2e_s for r in result.records if r.success)
    exposed = result.mean_transfer_exposed_s
    terms = MarginTerms(colo_e2e - (dis_e2e - exposed), exposed, inputs.route_delta_s, inputs.failure_penalty_s)
    return terms, tuple(router.decisions) if router else ()
