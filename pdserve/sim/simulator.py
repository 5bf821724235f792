"""The discrete-event simulator: a workload through a colocated or disaggregated deployment.

Contract: `simulate` is a pure function of (requests, rate, config, latency models). Every
request either finishes or is rejected up front (its prompt plus output can never fit one
instance's K/V pool), and `SimResult` reports both counts, so arrivals = finished + rejected.
Its records are the benchmark's `RequestRecord`s, to be scored with `pdserve.bench.metrics`.

Disaggregated: one prefill queue feeds `prefill_replicas` instances (`prefill_pool.py`); each
finished prompt (its first token, which fixes TTFT) goes to a decode instance chosen round-robin
in completion order, over that instance's ingress link (`transfer.py`), and decodes there
(`decode_pool.py`). Colocated: arrivals are dealt round-robin to `replicas` instances that mix
chunked prefill with decode (`colocated.py`). Routing is oblivious (round-robin), so instances
are independent and each is simulated by itself, with no global event heap.

Margin-routed (`decide` given, disaggregated only): the router decides per request, from the
deployment's live state at the arrival, to hand the request off or prefill it on its decode
instance (`margin_routed.py`, one event clock); `SimResult.local_requests` names those kept
local and `arrival_views` what each decision read. Without `decide` every request is handed off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.bench.records import RequestRecord
from pdserve.sim.colocated import ColocatedLimits, run_colocated_instance
from pdserve.sim.decode_pool import DecodeLimits, run_decode_instance
from pdserve.latency.base import LatencyModel
from pdserve.sim.margin_routed import ArrivalView, Decide, RoutedShape, run_margin_routed
from pdserve.sim.prefill_pool import PrefillPolicy, run_prefill_pool
from pdserve.sim.requests import SimRequests, records
from pdserve.sim.transfer import IngressLinks, LinkSpec

MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class SimConfig:
    """Deployment shape and scheduler knobs."""

    mode: str = "disaggregated"
    replicas: int = 1
    prefill_replicas: int = 1
    decode_replicas: int = 1
    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    chunk_tokens: int = 512
    max_decode_seqs: int = 256
    link: LinkSpec = field(default_factory=LinkSpec)
    mixed_batches: bool = True  # colocated: False = prefill-only iterations while decodes wait (colocated.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if min(self.replicas, self.prefill_replicas, self.decode_replicas) < 1:
            raise ValueError("every pool needs at least one instance")

    @property
    def instances(self) -> int:
        return self.replicas if self.mode == "colocated" else self.prefill_replicas + self.decode_replicas


@dataclass(frozen=True)
class SimResult:
    """Records (request-id order) and the conservation counts."""

    records: list[RequestRecord]
    num_arrived: int
    num_finished: int
    num_rejected: int
    num_preempted: int
    mean_transfer_exposed_s: float = 0.0
    local_requests: tuple[int, ...] = ()  # margin-routed: prefilled on their decode instance
    arrival_views: tuple[ArrivalView, ...] = ()  # margin-routed: what each decision read, in arrival order


def simulate(
    requests: SimRequests,
    rate: float | None,
    config: SimConfig,
    prefill_model: LatencyModel,
    decode_model: LatencyModel | None = None,
    decide: Decide | None = None,
) -> SimResult:
    """Run the workload at `rate` req/s; colocated uses `prefill_model` for its instances;
    `decide`: route each disaggregated request by it (module contract)."""
    arrivals = requests.arrivals_at(rate)
    if config.mode == "colocated":
        return _colocated(requests, arrivals, config, prefill_model)
    if decide is not None:
        return _margin_routed(requests, arrivals, config, prefill_model, decode_model or prefill_model, decide)
    return _disaggregated(requests, arrivals, config, prefill_model, decode_model or prefill_model)


def _rejected(requests: SimRequests, *capacities: int | None) -> list[bool]:
    caps = [c for c in capacities if c is not None]
    if not caps:
        return [False] * len(requests)
    cap = min(caps)
    return [p + o > cap for p, o in zip(requests.prompt_tokens, requests.output_tokens)]


def _arrival_order(arrivals: list[float], rejected: list[bool]) -> list[int]:
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    return [i for i in order if not rejected[i]]


def _result(requests, arrivals, first, finish, rejected, preempted: int, exposed_s: float = 0.0) -> SimResult:
    num_rejected = sum(rejected)
    return SimResult(
        records=records(requests, arrivals, first, finish, rejected),
        num_arrived=len(arrivals),
        num_finished=len(arrivals) - num_rejected,
        num_rejected=num_rejected,
        num_preempted=preempted,
        mean_transfer_exposed_s=exposed_s,
    )


def _colocated(requests: SimRequests, arrivals: list[float], config: SimConfig, model: LatencyModel) -> SimResult:
    limits = ColocatedLimits(config.chunk_tokens, config.max_decode_seqs, model.kv_capacity_tokens, config.mixed_batches)
    rejected = _rejected(requests, limits.capacity_tokens)
    order = _arrival_order(arrivals, rejected)
    n = len(arrivals)
    first, finish, preempted = [0.0] * n, [0.0] * n, 0
    for r in range(config.replicas):
        mine = order[r :: config.replicas]
        run = run_colocated_instance(
            [arrivals[i] for i in mine], mine, requests.prompt_tokens, requests.output_tokens,
            requests.cached_tokens, model, limits,
        )
        for i in mine:
            first[i], finish[i] = run.first_token_s[i], run.finish_s[i]
        preempted += run.num_preempted
    return _result(requests, arrivals, first, finish, rejected, preempted)


def _disaggregated(requests, arrivals, config: SimConfig, prefill_model: LatencyModel, decode_model: LatencyModel) -> SimResult:
    rejected = _rejected(requests, prefill_model.kv_capacity_tokens, decode_model.kv_capacity_tokens)
    order = _arrival_order(arrivals, rejected)
    new = [p - c for p, c in zip(requests.prompt_tokens, requests.cached_tokens)]
    pre = run_prefill_pool(arrivals, order, new, requests.cached_tokens, prefill_model, config.prefill_replicas, config.prefill)
    finish = list(pre.done_s)
    ready_by, idxs_by, exposed_s = _handoff(requests, order, pre, config, decode_model.kv_bytes_per_token)
    limits = DecodeLimits(config.max_decode_seqs, decode_model.kv_capacity_tokens)
    preempted = 0
    for ready, idxs in zip(ready_by, idxs_by):
        run = run_decode_instance(ready, idxs, requests.prompt_tokens, requests.output_tokens, decode_model, limits)
        for i, t in run.finish_s.items():
            finish[i] = t
        preempted += run.num_preempted
    return _result(requests, arrivals, pre.done_s, finish, rejected, preempted, exposed_s)


def _margin_routed(requests, arrivals, config: SimConfig, prefill_model: LatencyModel, decode_model: LatencyModel,
                   decide: Decide) -> SimResult:
    if config.prefill != PrefillPolicy():
        raise ValueError("margin routing simulates the FCFS single-request prefill pool only")
    rejected = _rejected(requests, prefill_model.kv_capacity_tokens, decode_model.kv_capacity_tokens)
    shape = RoutedShape(config.prefill_replicas, config.decode_replicas, config.chunk_tokens, config.max_decode_seqs,
                        config.link)
    run = run_margin_routed(arrivals, _arrival_order(arrivals, rejected), requests.prompt_tokens, requests.output_tokens,
                            requests.cached_tokens, shape, prefill_model, decode_model, decide)
    result = _result(requests, arrivals, run.first_token_s, run.finish_s, rejected, run.num_preempted,
                     run.mean_transfer_exposed_s)
    local = tuple(v.request for v in run.views if not run.disaggregated[v.request])
    return dataclasses.replace(result, local_requests=local, arrival_views=run.views)


def _handoff(requests: SimRequests, order: list[int], pre, config: SimConfig, kv_bytes_per_token: int):
    """Per decode instance: (sorted ready times, request ids); plus mean exposed transfer."""
    done = pre.done_s
    moving = sorted((i for i in order if requests.output_tokens[i] > 1), key=done.__getitem__)
    ready_by = [[] for _ in range(config.decode_replicas)]
    idxs_by = [[] for _ in range(config.decode_replicas)]
    links = IngressLinks(config.link, kv_bytes_per_token, config.decode_replicas)
    for k, i in enumerate(moving):
        r = k % config.decode_replicas
        ready_by[r].append(links.send(pre.start_s[i], done[i], requests.prompt_tokens[i], r))
        idxs_by[r].append(i)
    return ready_by, idxs_by, links.mean_exposed_s
