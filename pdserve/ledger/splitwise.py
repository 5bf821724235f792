"""Splitwise pool ledger (spec 0x08F-0x08I).

Routing is join-the-shortest-queue by pending tokens among workers with K/V headroom; a
mixed machine counts once in both phase constraints; prompt batching is strict FCFS under a
token cap; a mixed machine only preempts token work that is young and under its preemption
cap; per-layer streaming follows v_l = max(r_l, v_{l-1}) + x_l on one serial engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class WorkerLoad:
    """A (possibly stale) worker report: pending tokens and free K/V bytes."""

    name: str
    pending_tokens: int
    kv_free_bytes: int = 0


def jsq_by_pending_tokens(workers: Sequence[WorkerLoad], need_kv_bytes: int = 0) -> WorkerLoad | None:
    """Worker with the fewest pending tokens among those with `need_kv_bytes` headroom.

    Ties break by name so the choice is deterministic; None when nobody qualifies.
    """
    eligible = [w for w in workers if w.kv_free_bytes >= need_kv_bytes]
    if not eligible:
        return None
    return min(eligible, key=lambda w: (w.pending_tokens, w.name))


def static_capacity_rps(prompt_machines: int, prompt_rps: float, token_machines: int, token_rps: float) -> float:
    """G_static = min(N_P * g_P, N_T * g_T)."""
    return min(prompt_machines * prompt_rps, token_machines * token_rps)


@dataclass(frozen=True)
class MixedCapacity:
    prompt_side_rps: float
    token_side_rps: float

    @property
    def system_rps(self) -> float:
        return min(self.prompt_side_rps, self.token_side_rps)


def mixed_capacity(
    prompt_machines: int,
    prompt_rps: float,
    token_machines: int,
    token_rps: float,
    borrowed_prompt_machines: int,
    mixed_rps: float,
) -> MixedCapacity:
    """Borrow b prompt-origin machines into the mixed pool.

    Prompt side: (N_P - b) g_P + b g_M; token side: N_T g_T + b g_M. The mixed rate appears in
    both constraints because those requests run both phases on the same machine.
    """
    if not 0 <= borrowed_prompt_machines <= prompt_machines:
        raise ValueError("cannot borrow more prompt machines than exist")
    b = borrowed_prompt_machines
    return MixedCapacity(
        prompt_side_rps=(prompt_machines - b) * prompt_rps + b * mixed_rps,
        token_side_rps=token_machines * token_rps + b * mixed_rps,
    )


def fcfs_prompt_batch(queue_tokens: Sequence[int], token_cap: int) -> int:
    """How many queue-head prompts fit under the cap without reordering.

    Stops at the first prompt that would overflow, even if a later one would fit. A single
    prompt larger than the cap is admitted alone so the queue cannot stall.
    """
    used = 0
    for count, tokens in enumerate(queue_tokens):
        if used + tokens > token_cap:
            return count if count > 0 else 1
        used += tokens
    return len(queue_tokens)


def choose_mixed_phase(
    prompt_pending: bool, token_age_ms: float, token_preemptions: int, age_override_ms: float, max_preemptions: int
) -> str:
    """'prompt' only when prompt work waits and the token request is young and under its cap."""
    if not prompt_pending:
        return "token"
    if token_age_ms >= age_override_ms or token_preemptions >= max_preemptions:
        return "token"
    return "prompt"


def layer_visibility_s(ready_s: Sequence[float], transfer_s: Sequence[float]) -> list[float]:
    """Per-layer streaming on one serial engine: v_l = max(r_l, v_{l-1}) + x_l, v_{-1} = 0."""
    if len(ready_s) != len(transfer_s):
        raise ValueError("ready and transfer lists must have one entry per layer")
    visible, last = [], 0.0
    for ready, duration in zip(ready_s, transfer_s):
        last = max(ready, last) + duration
        visible.append(last)
    return visible


def serialized_completion_s(ready_s: Sequence[float], transfer_s: Sequence[float]) -> float:
    """Request-level transfer: wait for the last layer, then move everything."""
    if not ready_s:
        raise ValueError("need at least one layer")
    return ready_s[-1] + sum(transfer_s)


def transfer_method(prompt_tokens: int, per_layer_threshold_tokens: int) -> str:
    """'serialized' below the profiled threshold, 'per_layer' at or above it."""
    return "serialized" if prompt_tokens < per_layer_threshold_tokens else "per_layer"


@dataclass(frozen=True)
class RoleState:
    role: str  # "PROMPT" | "TOKEN" | "MIXED"
    epoch: int
    origin: str | None = None


def enter_mixed(state: RoleState) -> RoleState:
    """Dedicated -> MIXED; the origin role is remembered and the epoch advances."""
    if state.role == "MIXED":
        raise ValueError("worker is already mixed")
    return RoleState(role="MIXED", epoch=state.epoch + 1, origin=state.role)


def leave_mixed(state: RoleState) -> RoleState:
    """MIXED -> origin role; the epoch advances again."""
    if state.role != "MIXED" or state.origin is None:
        raise ValueError("only a mixed worker with an origin can return")
    return RoleState(role=state.origin, epoch=state.epoch + 1)


def admits_assignment(state: RoleState, assignment_epoch: int) -> bool:
    """Queued work is admitted only under the role epoch it was assigned in."""
    return assignment_epoch == state.epoch
