"""What a route policy reads besides the snapshot, and what it answers.

A policy (policies.py) is a pure function (snapshot, request, `PolicyContext`) -> `Choice` (the
prefill and decode slots, their hits, and for the cost-aware policies the pair's TTFT) or
`Refusal` (an early rejection reason and a retry-after hint). These types are shared by the
policies, their gates and pair search (pair_search.py), the plan (plan.py) and the router.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdserve.router.kv.prefix_terms import HostHeld, PrefixTerms
from pdserve.router.messages import RejectReason, RouteRequest, new_frozen
from pdserve.router.pricing.cost import CostModel
from pdserve.router.state.snapshot import Snapshot


@dataclass(frozen=True)
class PolicyContext:
    cost: CostModel
    ttft_slo_s: float = math.inf  # defaults for requests that carry none
    tpot_slo_s: float = math.inf
    turn: int = 0  # routes this policy made before; round robin's cursor
    retry_after_s: float = 1.0  # suggestion when capacity, not a clock, is the problem
    max_retry_after_s: float = 30.0
    kv_sharing: bool = False  # prefix policy: a prefix another worker holds counts, at its fetch cost
    kv_cost: CostModel | None = None  # prefix policy's fetch and host-copy terms (measured); None: `cost`
    host_held: HostHeld | None = None  # worker id -> its host-tier keys; None: no host-tier entry anywhere


@dataclass(frozen=True)
class Choice:
    prefill_slot: int
    decode_slot: int
    prefill_hit_blocks: int  # usable leading prefix reused at P
    decode_hit_blocks: int  # leading prefix already visible at D (not transferred)
    # the cost-aware policies' TTFT for the pair, the very sum `plan.predicted_clocks` would compute
    # (same formulas, same rounding), handed on so the plan need not recompute it; None: recompute
    ttft_s: float | None = field(default=None, compare=False)
    terms: PrefixTerms | None = field(default=None, compare=False)  # the prefix policy's, for the trace


@dataclass(frozen=True)
class Refusal:
    reason: RejectReason
    retry_after_s: float
    detail: str = ""


Hits = "np.ndarray | int"  # per-slot hit blocks, or one value for every slot
Policy = Callable[[Snapshot, RouteRequest, PolicyContext], "Choice | Refusal"]


def new_choice(p: int, d: int, p_hit: int, d_hit: int, ttft_s: float | None = None, terms: PrefixTerms | None = None) -> Choice:
    return new_frozen(Choice, prefill_slot=p, decode_slot=d, prefill_hit_blocks=p_hit, decode_hit_blocks=d_hit,
                      ttft_s=ttft_s, terms=terms)


def hit_at(hits: Hits, slot: int) -> int:
    return int(hits[slot]) if isinstance(hits, np.ndarray) else int(hits)
