"""Turn scored instances into deployments: replica counts, GPUs, K/V links and residency.

Contract: all capacity arithmetic is the ledger's (spec 0x08C-0x08D, 0x0A):
g_system = `system_goodput`(n_p g_p, n_d g_d); per-GPU goodput = `system_goodput_per_gpu` over
every GPU of both pools; replicas for a target rate = `replica_count`; K/V demand =
`payload_demand_bytes_per_s`(g_system, M_KV) checked by `link_feasible` against the pool's
handoff capacity; residency = `model_residency_bytes` over all instances; each phase's shape is
the ledger's `best_per_gpu`. With a GPU budget (and no target) the replica split maximises
g_system within the budget, fewer GPUs breaking ties.

High node affinity: phases are chosen independently; K/V crosses the inter-node NIC (one per
GPU). Low node affinity (DistServe's): every instance's layers are cut into the same s node
segments, segment j of every prefill and decode instance sits on node j of its group (checked
with the ledger's `stage_packing_violations`, a segment standing for a stage), and K/V moves over
NVLink. s divides both phases' PP degrees, which may differ: inside its segment an instance
keeps pp / s stages of its own (OPT-66B's prefill TP4 PP1 beside decode TP2 PP2 on one node is
s = 1). Every common divisor s is tried and the best packing kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.ledger.goodput import best_per_gpu, replica_count, system_goodput, system_goodput_per_gpu
from pdserve.ledger.placement import (
    StageSlot,
    link_feasible,
    model_residency_bytes,
    payload_demand_bytes_per_s,
    stage_packing_violations,
)
from pdserve.search.phase_search import Score


@dataclass(frozen=True)
class ColocatedPlan:
    score: Score
    replicas: int
    weight_bytes: int

    @property
    def gpus(self) -> int:
        return self.replicas * self.score.par.gpus

    @property
    def goodput_rps(self) -> float:
        return self.replicas * self.score.goodput_rps

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.gpus

    @property
    def residency_bytes(self) -> int:
        return model_residency_bytes(self.replicas, self.weight_bytes)


@dataclass(frozen=True)
class DisaggPlan:
    affinity: str  # "high" | "low"
    prefill: Score
    decode: Score
    n_prefill: int
    n_decode: int
    kv_bytes_per_request: float
    link_bytes_per_s_per_gpu: float
    weight_bytes: int
    segments: int = 0  # low affinity: the node segments both phases' layers are cut into

    @property
    def prefill_gpus(self) -> int:
        return self.n_prefill * self.prefill.par.gpus

    @property
    def decode_gpus(self) -> int:
        return self.n_decode * self.decode.par.gpus

    @property
    def gpus(self) -> int:
        return self.prefill_gpus + self.decode_gpus

    @property
    def goodput_rps(self) -> float:
        return system_goodput(self.n_prefill * self.prefill.goodput_rps, self.n_decode * self.decode.goodput_rps)

    @property
    def decode_capacity_rps(self) -> float:
        """The decode pool's sustained rate: n_d x one instance's (`Score.bound_rps`)."""
        return self.n_decode * self.decode.bound_rps

    @property
    def sustained_rps(self) -> float:
        """The rate the deployment sustains handing every request off (`plans.sustained_rps`)."""
        return sustained_rps(self.prefill, self.n_prefill, self.decode, self.n_decode)

    @property
    def goodput_per_gpu(self) -> float:
        return system_goodput_per_gpu(self.goodput_rps, self.prefill_gpus, self.decode_gpus)

    @property
    def kv_demand_bytes_per_s(self) -> float:
        return payload_demand_bytes_per_s(self.goodput_rps, self.kv_bytes_per_request)

    @property
    def link_capacity_bytes_per_s(self) -> float:
        return self.decode_gpus * self.link_bytes_per_s_per_gpu

    @property
    def link_ok(self) -> bool:
        return link_feasible(self.kv_demand_bytes_per_s, self.link_capacity_bytes_per_s)

    @property
    def residency_bytes(self) -> int:
        return model_residency_bytes(self.n_prefill + self.n_decode, self.weight_bytes)


def sustained_rps(prefill: Score, n_prefill: int, decode: Score, n_decode: int) -> float:
    """The ledger's system goodput of two pools' capacities, each n x one instance's sustained
    rate (`Score.bound_rps`: `candidates.prefill_bound` / `decode_bound`): past it a queue grows
    without end, however long a finite run hides it."""
    return system_goodput(n_prefill * prefill.bound_rps, n_decode * decode.bound_rps)


def _best(scores: list[Score]) -> Score | None:
    viable = [s for s in scores if s.goodput_rps > 0]
    if not viable:
        return None
    name, _, _ = best_per_gpu([(s.label, s.goodput_rps, s.par.gpus) for s in viable])
    return next(s for s in viable if s.label == name)


def colocated_plan(scores: list[Score], budget: int, target_rps: float | None, weight_bytes: int) -> ColocatedPlan | None:
    """Best per-GPU colocated instance, replicated to the target or to fill the budget."""
    best = _best(scores)
    if best is None or (target_rps is None and best.par.gpus > budget):
        return None
    replicas = replica_count(target_rps, best.goodput_rps) if target_rps else budget // best.par.gpus
    return ColocatedPlan(best, replicas, weight_bytes)


def split_budget(g_p: float, gpus_p: int, g_d: float, gpus_d: int, budget: int) -> tuple[int, int] | None:
    """(n_p, n_d) >= 1 maximising min(n_p g_p, n_d g_d) within `budget` GPUs."""
    best, best_key = None, None
    for n_p in range(1, budget // gpus_p + 1):
        n_d = (budget - n_p * gpus_p) // gpus_d
        if n_d < 1:
            break
        n_d = min(n_d, replica_count(n_p * g_p, g_d))  # decode beyond the prefill rate is idle
        key = (system_goodput(n_p * g_p, n_d * g_d), -(n_p * gpus_p + n_d * gpus_d))
        if best_key is None or key > best_key:
            best, best_key = (n_p, n_d), key
    return best


def high_affinity_plan(prefill: list[Score], decode: list[Score], budget: int, target_rps: float | None,
                       kv_bytes_per_request: float, nic_bytes_per_s: float, weight_bytes: int) -> DisaggPlan | None:
    """DistServe high node affinity: phases chosen independently.

    Target rate: each phase's best per GPU, replicated to the target. Budget: every pair of
    simulated phase shapes with its best split, keeping the highest g_system.
    """
    make = lambda c_p, c_d, n: DisaggPlan("high", c_p, c_d, n[0], n[1], kv_bytes_per_request, nic_bytes_per_s, weight_bytes)  # noqa: E731
    if target_rps:
        c_p, c_d = _best(prefill), _best(decode)
        if c_p is None or c_d is None:
            return None
        return make(c_p, c_d, (replica_count(target_rps, c_p.goodput_rps), replica_count(target_rps, c_d.goodput_rps)))
    plans = []
    for c_p, c_d in _viable_pairs(prefill, decode):
        counts = split_budget(c_p.goodput_rps, c_p.par.gpus, c_d.goodput_rps, c_d.par.gpus, budget)
        if counts is not None:
            plans.append(make(c_p, c_d, counts))
    return _top(plans, by_rate=True)


def low_affinity_plan(prefill: list[Score], decode: list[Score], budget: int, target_rps: float | None,
                      gpus_per_node: int, kv_bytes_per_request: float, nvlink_bytes_per_s: float,
                      weight_bytes: int) -> DisaggPlan | None:
    """DistServe low node affinity: both phases' layers cut into the same node segments, segment
    j of every instance on node j (the PP degrees may differ; see the module contract)."""
    plans = []
    for c_p, c_d in _viable_pairs(prefill, decode):
        for segments in common_segments(c_p.par.pp, c_d.par.pp):
            counts = _pack_low(c_p, c_d, segments, budget, target_rps, gpus_per_node)
            if counts is not None:
                plans.append(DisaggPlan("low", c_p, c_d, *counts, kv_bytes_per_request, nvlink_bytes_per_s,
                                        weight_bytes, segments))
    return _top(plans, by_rate=not target_rps)


def common_segments(pp_p: int, pp_d: int) -> list[int]:
    """Node segments s both phases can be cut into: the common divisors of their PP degrees."""
    return [s for s in range(1, min(pp_p, pp_d) + 1) if pp_p % s == 0 and pp_d % s == 0]


def _viable_pairs(prefill: list[Score], decode: list[Score]):
    return [(p, d) for p in prefill if p.goodput_rps > 0 for d in decode if d.goodput_rps > 0]


def _top(plans: list[DisaggPlan], by_rate: bool) -> DisaggPlan | None:
    """Highest g_system (budget) or goodput per GPU (target); fewer GPUs, then labels, break ties."""
    key = (lambda p: (p.goodput_rps, p.goodput_per_gpu, -p.gpus)) if by_rate else (lambda p: (p.goodput_per_gpu, -p.gpus))
    return max(sorted(plans, key=lambda p: (p.prefill.label, p.decode.label)), key=key, default=None)


def _pack_low(c_p: Score, c_d: Score, segments: int, budget: int, target_rps: float | None,
              gpus_per_node: int) -> tuple[int, int] | None:
    """Replica counts whose segment-j slices share node j within `gpus_per_node` GPUs each; an
    instance's slice of a node is tp * pp / segments GPUs."""
    w_p, w_d = c_p.par.gpus // segments, c_d.par.gpus // segments
    if target_rps:
        n_p, n_d = replica_count(target_rps, c_p.goodput_rps), replica_count(target_rps, c_d.goodput_rps)
        groups = -(-(n_p * w_p + n_d * w_d) // gpus_per_node)
        per_group = (-(-n_p // groups), -(-n_d // groups))
    else:
        groups = max(1, budget // (segments * gpus_per_node))
        per_node = min(gpus_per_node, budget // (groups * segments))
        per_group = split_budget(c_p.goodput_rps, w_p, c_d.goodput_rps, w_d, per_node) if per_node else None
    if per_group is None or stage_packing_violations(_group_slots(per_group, segments, w_p, w_d), segments, gpus_per_node):
        return None
    return per_group[0] * groups, per_group[1] * groups


def _group_slots(counts: tuple[int, int], segments: int, w_p: int, w_d: int) -> list[StageSlot]:
    """One node group: segment j of every prefill and decode instance on node j."""
    slots = []
    for phase, n, width in (("prefill", counts[0], w_p), ("decode", counts[1], w_d)):
        for k in range(n):
            slots.extend(StageSlot(f"{phase[0]}{k}", phase, j, f"node{j}", width) for j in range(segments))
    return slots
