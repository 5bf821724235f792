"""Score candidate instances by simulated goodput, pruning with the analytic bounds first.

Contract: each scorer returns one `Score` per candidate, best goodput per GPU first. A candidate
whose analytic capacity is zero (it misses an SLO at zero load) scores 0 without simulation; one
whose capacity per GPU is below the best simulated goodput per GPU so far is marked `pruned`
and not simulated (capacity bounds goodput, so it cannot win). Everything else gets a simulated
goodput search (`goodput.py`) on a ladder centred on its analytic estimate. A prefill or decode
instance scores at most its sustained rate (its capacity, `candidates.prefill_bound` /
`decode_bound`): past it the instance's queue grows without end, so no run long enough passes,
but a finite one can, where the queue's wait stays inside a loose TTFT, or spread over every
output token inside a loose TPOT. A colocated instance's queue waits before its prefill, in
TTFT, where the finite run shows it; its capacity is a pruning bound only.

All three phases run on `decode_requests`, a longer workload (several times the batch limit):
with only a few batches' worth of requests, an overloaded decode instance would still pass,
because TPOT spreads a queueing wait over every output token; and a prefill instance whose
whole backlog of a short burst fits inside the TTFT budget passed at any rate (a 5 ms prefill,
200 requests and a 1 s TTFT scored 102,143 req/s).

DistServe's decode batch budget is an option of the space, off by default: `decode_token_cap`
holds every decode instance's batch to that many tokens of context per pipeline stage
(`candidates.DecodeTokenCap`). `score_all(..., prune=False)` simulates every candidate, for a
rule that needs more than each phase's best per GPU (`segment_pairs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from pdserve.bench.metrics import Attainment, Slo
from pdserve.search.candidates import (
    DecodeTokenCap,
    Parallel,
    WorkloadShape,
    colocated_bound,
    decode_bound,
    latency_for,
    prefill_bound,
)
from pdserve.latency.geometry import ModelSpec
from pdserve.sim.goodput import decode_records, goodput_rps, ladder_around, prefill_records
from pdserve.latency.hardware import HardwareProfile
from pdserve.latency.base import LatencyModel
from pdserve.latency.spec import LatencyFamily
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.requests import SimRequests
from pdserve.sim.simulator import SimConfig, simulate

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Score:
    """One candidate instance: shape, chunk budget (colocated only) and per-instance goodput."""

    phase: str  # "prefill" | "decode" | "colocated"
    par: Parallel
    goodput_rps: float
    bound_rps: float
    status: str  # "simulated" | "infeasible" | "pruned"
    chunk_tokens: int = 0
    points: tuple[tuple[float, Attainment], ...] = ()

    @property
    def per_gpu(self) -> float:
        return self.goodput_rps / self.par.gpus

    @property
    def label(self) -> str:
        return f"{self.par}" + (f"-chunk{self.chunk_tokens}" if self.chunk_tokens else "")


@dataclass(frozen=True)
class SearchSpace:
    """What every scorer needs: model, hardware, workload, SLO and scheduler limits."""

    model: ModelSpec
    hardware: HardwareProfile
    requests: SimRequests
    decode_requests: SimRequests  # enough requests that an overloaded decode batch shows
    slo: Slo
    definition: str = "joint"
    max_seqs: int = 256
    prefill_policy: PrefillPolicy = PrefillPolicy()
    fixed_model: LatencyModel | None = None  # a measured profile replaces the roofline (tp=pp=1)
    family: LatencyFamily | None = None  # a model per shape (aiconfigurator) replaces the roofline
    mixed_batches: bool = True  # colocated: False = prefill-only iterations (DistServe's baseline)
    decode_token_cap: int | None = None  # DistServe's decode iteration budget per stage; None: K/V alone

    def latency(self, par: Parallel) -> LatencyModel:
        """The latency model of one instance of shape `par`."""
        if self.fixed_model is not None:
            return self.fixed_model
        return latency_for(self.model, self.hardware, par, self.family)

    def decode_latency(self, par: Parallel) -> LatencyModel:
        """The latency model of one decode instance of shape `par`, its batch held to
        `decode_token_cap` when set."""
        model = self.latency(par)
        return model if self.decode_token_cap is None else DecodeTokenCap(model, self.decode_token_cap)

    @property
    def shape(self) -> WorkloadShape:
        return WorkloadShape.of(self.requests)


def score_all(
    space: SearchSpace, phase: str, cands: Iterable[tuple[Parallel, int]], progress: Progress, prune: bool = True
) -> list[Score]:
    """Score (shape, chunk) candidates of one phase, most promising (by bound per GPU) first.

    A candidate is pruned only by a simulated one with the same PP degree and no more GPUs, so
    every instance size and PP degree the placement step may need keeps its best member;
    `prune=False` simulates every feasible candidate.
    """
    bounded = [(c, _bound(space, phase, c)) for c in cands]
    bounded.sort(key=lambda item: (-item[1][0] / item[0][0].gpus, item[0][0].gpus))
    scores: list[Score] = []
    for i, ((par, chunk), (cap, estimate)) in enumerate(bounded, 1):
        if cap <= 0:
            scores.append(Score(phase, par, 0.0, 0.0, "infeasible", chunk))
        elif prune and cap / par.gpus < _best_per_gpu(scores, par):
            scores.append(Score(phase, par, 0.0, cap, "pruned", chunk))
        else:
            found = goodput_rps(_runner(space, phase, par, chunk), space.slo, ladder_around(estimate), space.definition)
            rate = found.rate if phase == "colocated" else min(found.rate, cap)
            scores.append(Score(phase, par, rate, cap, "simulated", chunk, tuple(sorted(found.points.items()))))
        progress(f"{phase} {i}/{len(bounded)} {scores[-1].label}: {scores[-1].status} goodput {scores[-1].goodput_rps:.3g} rps")
    return sorted(scores, key=lambda s: (-s.per_gpu, s.par.gpus, s.label))


def _best_per_gpu(scores: list[Score], par: Parallel) -> float:
    """Best simulated goodput per GPU among candidates that could replace `par`."""
    return max((s.per_gpu for s in scores if s.status == "simulated" and s.par.pp == par.pp and s.par.gpus <= par.gpus), default=0.0)


def _bound(space: SearchSpace, phase: str, cand: tuple[Parallel, int]) -> tuple[float, float]:
    """(capacity, estimate) in rps of one instance."""
    model = space.decode_latency(cand[0]) if phase == "decode" else space.latency(cand[0])
    if phase == "prefill":
        policy = space.prefill_policy
        return prefill_bound(model, space.shape, space.slo, policy.max_batch, policy.max_batch_tokens)
    if phase == "decode":
        cap = decode_bound(model, space.shape, space.slo, space.max_seqs)
        return cap, cap
    return colocated_bound(model, space.shape, space.slo, space.max_seqs)


def _runner(space: SearchSpace, phase: str, par: Parallel, chunk: int):
    model = space.decode_latency(par) if phase == "decode" else space.latency(par)
    if phase == "prefill":  # the grown sample: a short burst's whole backlog can fit inside a TTFT budget
        return prefill_records(space.decode_requests, model, space.prefill_policy)
    if phase == "decode":
        return decode_records(space.decode_requests, model, space.max_seqs)
    config = SimConfig(mode="colocated", chunk_tokens=chunk, max_decode_seqs=space.max_seqs, mixed_batches=space.mixed_batches)
    return lambda rate: simulate(space.decode_requests, rate, config, model).records
