"""Distributed K/V memory ledger: MemServe call geometry and Mooncake routing (0x09E-0x09I).

Mooncake-style pricing for a request of S blocks at prefill candidate i with local prefix P_i,
best remote prefix P* anywhere, queue Q_i, per-block prefill time c_p and per-block transfer
time c_x:
    local  = Q_i + (S - P_i) * c_p
    remote = Q_i + (P* - P_i) * c_x + (S - P*) * c_p
The remote path is only priced when P* - P_i reaches the cache-balancing threshold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

CALL_MODES = ("discrete", "batched", "aggregated")


@dataclass(frozen=True)
class CallGeometry:
    api_calls: int
    network_transfers: int


def call_geometry(layers: int, mode: str) -> CallGeometry:
    """Calls for a layout with separate K and V blocks per layer (2L block addresses).

    discrete: one API call and one network op per block;
    batched: one API call listing all blocks, each still its own network op;
    aggregated: blocks packed into one contiguous region, one call and one op.
    """
    if layers <= 0:
        raise ValueError("layers must be positive")
    blocks = 2 * layers
    if mode == "discrete":
        return CallGeometry(blocks, blocks)
    if mode == "batched":
        return CallGeometry(1, blocks)
    if mode == "aggregated":
        return CallGeometry(1, 1)
    raise ValueError(f"unknown call mode {mode!r}; expected one of {CALL_MODES}")


def prefix_hash_chain(identity: str, blocks: Sequence[Sequence[int]]) -> list[str]:
    """h_j = H(identity || h_{j-1} || tokens_j) with h_{-1} = H(root); sha256 hex digests."""
    parent = hashlib.sha256(b"root").hexdigest()
    out = []
    for tokens in blocks:
        payload = f"{identity}|{parent}|{','.join(str(t) for t in tokens)}".encode()
        parent = hashlib.sha256(payload).hexdigest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class PrefillCandidate:
    name: str
    queue_s: float
    local_prefix_blocks: int


@dataclass(frozen=True)
class PrefillCost:
    name: str
    local_s: float
    remote_s: float | None

    @property
    def best_s(self) -> float:
        return self.local_s if self.remote_s is None else min(self.local_s, self.remote_s)

    @property
    def path(self) -> str:
        return "remote" if self.remote_s is not None and self.remote_s < self.local_s else "local"


def prefill_cost(
    candidate: PrefillCandidate,
    request_blocks: int,
    best_remote_prefix_blocks: int,
    prefill_s_per_block: float,
    transfer_s_per_block: float,
    balance_threshold_blocks: int,
) -> PrefillCost:
    """Local-recompute and (when the extra prefix is large enough) remote-reuse TTFT estimates."""
    p_i, p_star, s = candidate.local_prefix_blocks, best_remote_prefix_blocks, request_blocks
    if not 0 <= p_i <= s or not 0 <= p_star <= s:
        raise ValueError("prefix lengths must lie within the request")
    local = candidate.queue_s + (s - p_i) * prefill_s_per_block
    remote = None
    if p_star - p_i >= max(balance_threshold_blocks, 1):
        remote = candidate.queue_s + (p_star - p_i) * transfer_s_per_block + (s - p_star) * prefill_s_per_block
    return PrefillCost(candidate.name, local, remote)


def choose_prefill(costs: Sequence[PrefillCost]) -> PrefillCost:
    """Lowest predicted TTFT; name breaks ties."""
    if not costs:
        raise ValueError("no prefill candidates")
    return min(costs, key=lambda c: (c.best_s, c.name))


@dataclass(frozen=True)
class RouteDecision:
    admitted: bool
    prefill: str | None
    decode: str | None
    reason: str


def route_or_reject(
    costs: Sequence[PrefillCost], decode_tbt_s: dict[str, float], ttft_gate_s: float, tbt_gate_s: float
) -> RouteDecision:
    """Pick the cheapest prefill and the lowest-TBT decode; reject before any prefill work
    when either gate fails (early rejection spends no prompt compute)."""
    prefill = choose_prefill(costs)
    if not decode_tbt_s:
        return RouteDecision(False, None, None, "no decode candidate")
    decode = min(decode_tbt_s, key=lambda name: (decode_tbt_s[name], name))
    if prefill.best_s > ttft_gate_s:
        return RouteDecision(False, None, None, f"predicted TTFT {prefill.best_s:.6g}s exceeds gate")
    if decode_tbt_s[decode] > tbt_gate_s:
        return RouteDecision(False, None, None, f"predicted TBT {decode_tbt_s[decode]:.6g}s exceeds gate")
    return RouteDecision(True, prefill.name, decode, "admitted")
