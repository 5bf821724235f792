"""The router's cost model at the deployment's tensor-parallel sizes (issue 23, part 4).

Contract: `tp_cost(base, scaling, prefill_tp, decode_tp, measured_tp)` is `base` (a model of
steps measured at TP `measured_tp`: a profile's `meta.tp`, 1 for the placeholders and for
profiles without it) with its prefill terms priced at the prefill role's TP size and its decode
terms at the decode role's, and the `decode_worker_prefill_*` fields set so that
`CostModel.at_decode_worker` prices a prefill on a decode worker at the decode role's size. Every
price is `TpScaling.price` (latency/tp_scaling.py), the one formula: a factor on every term of
the phase, its fixed cost per step added to the step's fixed term (`prefill_overhead_s`,
`decode_step_base_s`) and its cost per row to the per-row term (`prefill_s_per_token`,
`decode_step_s_per_seq`); a role measured at its own TP size keeps the measured terms.
`scaling_for` builds the scaling of a served model: the profile's thread count stands for a TP 1
worker's when the profile was measured at TP 1, and its `collectives` section (measured by
`pdserve profile --tp N`) prices the collectives, the documented defaults without one.

`TpPricing` prices per worker: `pair(p_tp, d_tp)` is `tp_cost` at a chosen pair's own sizes
(cached: a deployment has few), `worker(tp)` a worker's own steps, both phases at its size. The
router (RouterConfig.pricing) prices every snapshot slot at its worker's registered TP size
(`WorkerInfo.tp`), and each route and P/D decision at its pair's, so a mixed worker, a worker that
changed role (its ranks stay those it started with) and a pool that holds two sizes are each
priced at their own size; the deployment's role sizes give `RouterConfig.cost` (`pair` at them).
`worker(tp, prefill_live, decode_live)` prices a served worker's phases with the collectives its
own steps show (router/pricing/live_collectives.py), by the same `TpScaling.price`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.latency.tp_collectives import CollectiveCosts
from pdserve.latency.tp_scaling import StepPrice, TpScaling, model_scaling
from pdserve.router.pricing.cost import CostModel

COMPUTE_BYTES = {"bfloat16": 2, "float32": 4}


def tp_cost(base: CostModel, scaling: TpScaling, prefill_tp: int, decode_tp: int, measured_tp: int = 1,
            live: tuple[CollectiveCosts | None, ...] = (None, None, None)) -> CostModel:
    """`live`: the prefill worker's prefill, the decode worker's decode and its prefill collectives
    as their own steps show them (router/pricing/live_collectives.py), None where the measured ones stand."""
    prefill = scaling.price("prefill", prefill_tp, measured_tp, live[0])
    decode = scaling.price("decode", decode_tp, measured_tp, live[1])
    local = scaling.price("prefill", decode_tp, measured_tp, live[2]).relative_to(prefill)
    cost = priced(base, prefill, decode)
    if local == StepPrice(1.0, 0.0, 0.0):
        return cost
    # at_decode_worker computes factor * term + extra; the extras are chosen so that no term falls below 0
    fixed = _at_least_zero(cost.prefill_overhead_s * local.factor, local.fixed_s)
    per_token = _at_least_zero(cost.prefill_s_per_token * local.factor, local.per_row_s)
    return replace(cost, decode_worker_prefill_factor=local.factor, decode_worker_prefill_fixed_s=fixed,
                   decode_worker_prefill_s_per_token=per_token)


@dataclass(frozen=True)
class TpPricing:
    """The cost model of any (prefill TP, decode TP) pair from one measured model (`tp_cost`)."""

    base: CostModel  # the steps as measured (at `measured_tp`)
    scaling: TpScaling
    measured_tp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pairs", {})  # derived, not a field: eq, hash and repr ignore it

    def pair(self, prefill_tp: int, decode_tp: int, live: tuple[CollectiveCosts | None, ...] | None = None) -> CostModel:
        """Prefill terms at `prefill_tp`, decode terms (and `at_decode_worker`) at `decode_tp`;
        `live`: as `tp_cost`'s (not cached)."""
        if live is not None:
            return tp_cost(self.base, self.scaling, prefill_tp, decode_tp, self.measured_tp, live)
        pairs = self.__dict__["_pairs"]
        found = pairs.get((prefill_tp, decode_tp))
        if found is None:
            found = pairs[(prefill_tp, decode_tp)] = tp_cost(self.base, self.scaling, prefill_tp, decode_tp, self.measured_tp)
        return found

    def worker(self, tp: int, prefill_live: CollectiveCosts | None = None,
               decode_live: CollectiveCosts | None = None) -> CostModel:
        """One worker's own steps: both phases at its TP size; a phase given its `*_live`
        collectives (the worker's own, router/pricing/live_collectives.py) is priced with them (not cached)."""
        if prefill_live is None and decode_live is None:
            return self.pair(tp, tp)
        return self.pair(tp, tp, (prefill_live, decode_live, prefill_live))  # its own prefill: its own collectives


def worker_cost(pricing: TpPricing | None, cost: CostModel, tp: int, decode_role: bool,
                live: CostModel | None = None) -> CostModel:
    """One worker's own steps: both phases at its TP size `tp` (`live`: its price from its own
    collectives, when the router has one); without pricing `cost`, a decode worker's prefill at
    the decode role's size (`at_decode_worker`)."""
    if pricing is not None:
        return live or pricing.worker(tp)
    return cost.at_decode_worker() if decode_role else cost


def _at_least_zero(term: float, extra: float) -> float:
    """`extra`, or what keeps term + extra at 0 when it would go below: a step that measured less
    than the collectives priced for its size (measured on a quieter machine than the collectives)."""
    return extra if term + extra >= 0 else -term


def priced(base: CostModel, prefill: StepPrice, decode: StepPrice) -> CostModel:
    """`base` with each phase's terms at its price: a prefill step's rows are its tokens, a decode
    step's its sequences (no term below 0, as `_at_least_zero`)."""
    cost = base.scaled(prefill.factor, decode.factor)
    if (prefill.fixed_s, prefill.per_row_s, decode.fixed_s, decode.per_row_s) == (0.0, 0.0, 0.0, 0.0):
        return cost
    terms = {"prefill_overhead_s": prefill.fixed_s, "prefill_s_per_token": prefill.per_row_s,
             "decode_step_base_s": decode.fixed_s, "decode_step_s_per_seq": decode.per_row_s}
    return replace(cost, **{name: max(0.0, getattr(cost, name) + extra) for name, extra in terms.items()})


def measured_tp(profile: dict | None) -> int:
    """The TP size a profile's steps were timed at (1 when it does not say, or no profile)."""
    return int((profile or {}).get("meta", {}).get("tp", 1))


def scaling_for(mc, profile: dict | None, threads_per_worker: int) -> TpScaling:
    """The documented model for `mc`, with a TP 1 worker's threads: the profile's own when it
    timed TP 1 (those are the threads its terms describe), else the served `threads_per_worker`;
    the profile's measured collectives and compute dtype (bf16 when it does not say)."""
    threads = threads_per_worker
    meta = (profile or {}).get("meta", {})
    if profile is not None and measured_tp(profile) == 1:
        threads = int(meta.get("threads") or threads_per_worker)
    compute = meta.get("compute_dtype") or meta.get("dtype") or "bfloat16"
    collectives = tuple(CollectiveCosts.from_dict(c) for c in (profile or {}).get("collectives", ()))
    return model_scaling(mc, threads, COMPUTE_BYTES.get(compute, 2), collectives)


def role_sizes(mode: str, prefill_tp: int, decode_tp: int, other_tp: int) -> tuple[int, int]:
    """(prefill-phase TP, decode-phase TP) of a deployment: colocated workers run both at theirs."""
    return (other_tp, other_tp) if mode == "colocated" else (prefill_tp, decode_tp)
