"""Typed messages between workers, the router and the runtime that drives it.

Workers send `WorkerInfo` once per role epoch, then `WorkerLoad` reports and heartbeats. The
runtime asks for a route with a `RouteRequest` and gets back either a `RoutePlan` (with the block
holds the router has taken on its behalf) or a `RouteRejection` it turns into 503 + Retry-After.
All messages are frozen; units are in the field names (tokens, blocks, bytes, seconds).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeVar


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    MIXED = "mixed"  # Splitwise's mixed pool: prompt or token work, as the pools' pressure says (router/splitwise/mixed_pool.py)


class RejectReason(str, enum.Enum):
    """Why a request was refused before any prefill work was spent on it."""

    NO_ROUTE = "no_route"  # no live worker of a needed role
    NO_TRANSFER_BUFFER = "no_transfer_buffer"  # no prefill worker can hold the prompt K/V
    NO_DECODE_CAPACITY = "no_decode_capacity"  # no decode worker can reserve prompt + growth
    TPOT_SLO = "tpot_slo"  # every decode worker with capacity would miss the TPOT target
    TTFT_SLO = "ttft_slo"  # the fastest feasible pair would miss the TTFT target


@dataclass(frozen=True)
class WorkerInfo:
    """Registration: who the worker is and what it can hold, valid for one role epoch."""

    worker_id: str
    host_id: str
    role: Role
    role_epoch: int
    kv_capacity_blocks: int
    model_identity: str
    kv_abi_hash: str
    tp: int = 1  # tensor-parallel ranks: the router prices the worker's steps at this size (tp_pricing.py)

    def __post_init__(self) -> None:
        if self.role_epoch < 0 or self.kv_capacity_blocks <= 0 or self.tp < 1:
            raise ValueError(f"bad registration for {self.worker_id}: epoch, capacity and TP size must be positive")


@dataclass(frozen=True)
class WorkerLoad:
    """A periodic load report.

    `free_blocks` counts blocks free in the worker's pool after every grant it has applied.
    `applied_grant_seq` is the highest router grant sequence number the worker has applied
    (grants travel to a worker over one ordered channel); holds with a higher sequence are still
    "in flight" and the router charges them against this report itself. `prefix_hashes` is the set
    of prefix-block hashes the worker holds, or None when unchanged since its previous report.
    """

    pending_prompt_tokens: int
    active_batch: int
    free_blocks: int
    applied_grant_seq: int = 0
    prefix_hashes: frozenset[int] | None = None


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs to place a request. `block_hashes` covers full 16-token blocks only."""

    request_id: str
    prompt_tokens: int
    expected_output_tokens: int
    block_hashes: tuple[int, ...] = ()
    ttft_slo_s: float | None = None  # None: use the router's default
    tpot_slo_s: float | None = None
    heavy: bool = False  # a predicted-heavy decode (router/tetri/reserve_mode.py), for --decode-choice p2c

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0 or self.expected_output_tokens < 0:
            raise ValueError(f"request {self.request_id}: prompt must be non-empty, output non-negative")


@dataclass(frozen=True)
class BlockHold:
    """Blocks the router set aside on one worker for one request, with the grant's sequence."""

    worker_id: str
    role_epoch: int
    blocks: int
    grant_seq: int


@dataclass(frozen=True)
class RoutePlan:
    """An admitted route. For colocated routes, and disaggregated ones whose P/D decision chose a
    local prefill on the decode worker, prefill_id == decode_id and transfer is zero.

    `prefill_hold` covers blocks newly allocated at P for the prompt (held until the K/V is
    published at D; None for colocated). `decode_hold` is the decode reservation: blocks at D for
    the part of the prompt D cannot already see plus the expected decode growth.
    """

    request_id: str
    policy: str
    prefill_id: str
    decode_id: str
    prefill_hit_blocks: int
    decode_hit_blocks: int
    compute_tokens: int
    transfer_tokens: int
    transfer_bytes: int
    predicted_ttft_s: float
    predicted_tpot_s: float
    prefill_hold: BlockHold | None
    decode_hold: BlockHold
    pd: object = None  # the request's P/D decision (router/pd_decision.PdDecision); None when colocated
    prefix_terms: object = None  # the prefix policy's cost terms (router/prefix_terms.PrefixTerms), or None

    @property
    def colocated(self) -> bool:
        return self.prefill_id == self.decode_id


@dataclass(frozen=True)
class RouteRejection:
    """An early refusal, before any prefill work; the HTTP layer answers 503 + Retry-After."""

    request_id: str
    policy: str
    reason: RejectReason
    retry_after_s: float
    detail: str = ""


# ---- building frozen messages on the routing hot path -----------------------------------------
# A frozen dataclass's `__init__` sets every field through `object.__setattr__`, about as costly as
# the rest of a small routing step. `new_frozen` builds an object indistinguishable from a normal
# one (same `__dict__`: equality, hashing and repr agree); callers pass every field, defaults
# included, and only for classes without `__post_init__` checks.
T = TypeVar("T")

_new = object.__new__


def new_frozen(cls: type[T], **fields: Any) -> T:
    obj = _new(cls)
    obj.__dict__.update(fields)
    return obj
