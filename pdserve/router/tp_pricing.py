"""The router's cost model at the deployment's tensor-parallel sizes (issue 23, part 4).

Contract: `tp_cost(base, scaling, prefill_tp, decode_tp, measured_tp)` is `base` (a model of
steps measured at TP `measured_tp`: a profile's `meta.tp`, 1 for the placeholders and for
profiles without it) with its prefill terms priced at the prefill role's TP size and its decode
terms at the decode role's, and `decode_worker_prefill_factor` set so that
`CostModel.at_decode_worker` prices a prefill on a decode worker at the decode role's size. Every
factor is `TpScaling.factor` (latency/tp_scaling.py), the one formula; a role measured at its own
TP size keeps the measured terms (factor 1). `scaling_for` builds the scaling of a served model:
the profile's thread count stands for a TP 1 worker's when the profile was measured at TP 1.

Pricing is per role, as deployments are (`--prefill-tp`, `--decode-tp`, `--tp`): a colocated
worker prices both phases at its size. A mixed worker (splitwise's mixed pool) is priced at the
size of the pool it serves in, and a worker that changed role at its new role's size (its ranks
stay those it started with).
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.latency.tp_scaling import TpScaling, model_scaling
from pdserve.router.cost import CostModel


def tp_cost(base: CostModel, scaling: TpScaling, prefill_tp: int, decode_tp: int, measured_tp: int = 1) -> CostModel:
    prefill = scaling.factor("prefill", prefill_tp, measured_tp)
    decode = scaling.factor("decode", decode_tp, measured_tp)
    local = scaling.factor("prefill", decode_tp, measured_tp) / prefill
    cost = base.scaled(prefill, decode)
    return cost if local == cost.decode_worker_prefill_factor else replace(cost, decode_worker_prefill_factor=local)


def measured_tp(profile: dict | None) -> int:
    """The TP size a profile's steps were timed at (1 when it does not say, or no profile)."""
    return int((profile or {}).get("meta", {}).get("tp", 1))


def scaling_for(mc, profile: dict | None, threads_per_worker: int) -> TpScaling:
    """The documented model for `mc`, with a TP 1 worker's threads: the profile's own when it
    timed TP 1 (those are the threads its terms describe), else the served `threads_per_worker`."""
    threads = threads_per_worker
    if profile is not None and measured_tp(profile) == 1:
        threads = int(profile.get("meta", {}).get("threads") or threads_per_worker)
    return model_scaling(mc, threads)


def role_sizes(mode: str, prefill_tp: int, decode_tp: int, other_tp: int) -> tuple[int, int]:
    """(prefill-phase TP, decode-phase TP) of a deployment: colocated workers run both at theirs."""
    return (other_tp, other_tp) if mode == "colocated" else (prefill_tp, decode_tp)
