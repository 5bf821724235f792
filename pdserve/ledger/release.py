"""Release contract for the P/D feature: state machine, rollback order, transfer capabilities
(spec 0x0FE-0x0FH). Pure functions; the release controller and transports enforce them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

ROLLBACK_ORDER = (
    "STOP_NEW_ROUTES",
    "ADVANCE_ROUTE_EPOCH",
    "DRAIN_OR_ABORT_TRANSFERS",
    "ENABLE_COLOCATED_FALLBACK",
    "DISABLE_CONNECTOR",
    "REVOKE_CAPABILITIES",
    "RECLAIM_UNPUBLISHED",
    "ROLLBACK_COMPLETE",
)

RELEASE_TRANSITIONS: Mapping[str, frozenset[str]] = {
    "PINNED": frozenset({"SHADOW", "ROLLING_BACK"}),
    "SHADOW": frozenset({"CANARY", "ROLLING_BACK"}),
    "CANARY": frozenset({"ACTIVE", "ROLLING_BACK"}),
    "ACTIVE": frozenset({"ROLLING_BACK"}),
    "ROLLING_BACK": frozenset({"ROLLED_BACK"}),
    "ROLLED_BACK": frozenset(),
}


def release_path_error(states: Sequence[str]) -> str | None:
    """First illegal step in a release trace that must start at PINNED, or None."""
    if not states or states[0] != "PINNED":
        return "a release trace starts at PINNED"
    for before, after in zip(states, states[1:]):
        if after not in RELEASE_TRANSITIONS.get(before, frozenset()):
            return f"illegal release transition {before} -> {after}"
    return None


def rollback_order_error(steps: Sequence[str]) -> str | None:
    """None when `steps` is exactly the rollback order; else the first divergence."""
    for index, expected in enumerate(ROLLBACK_ORDER):
        got = steps[index] if index < len(steps) else None
        if got != expected:
            return f"rollback step {index + 1} is {got}, expected {expected}"
    if len(steps) > len(ROLLBACK_ORDER):
        return f"unexpected rollback steps after completion: {list(steps[len(ROLLBACK_ORDER):])}"
    return None


CAPABILITY_EQUALITIES = ("tenant", "source", "destination", "transfer_id", "generation", "cache_abi", "direction", "nonce")


def authorization_error(
    request: Mapping, capability: Mapping, now_s: float, route_epoch: int, trusted_issuers: Sequence[str], max_ttl_s: float
) -> str | None:
    """Why a transfer request is denied under a capability, or None to allow exactly its regions.

    Gates: valid signature from a trusted issuer, unexpired with bounded lifetime, equal
    identity fields, current route epoch, requested regions a subset of allowed ones, and
    0 < bytes <= max bytes. Nonce single-use is the control plane's job, not checked here.
    """
    if not capability.get("signature_valid") or capability.get("issuer") not in trusted_issuers:
        return "capability not signed by a trusted control plane"
    remaining = capability.get("expires_at_s", 0) - now_s
    if not 0 < remaining <= max_ttl_s:
        return f"capability lifetime {remaining:g}s outside (0, {max_ttl_s:g}]"
    for name in CAPABILITY_EQUALITIES:
        if request.get(name) != capability.get(name):
            return f"capability {name} {capability.get(name)!r} does not match request {request.get(name)!r}"
    if capability.get("route_epoch") != route_epoch:
        return f"capability route epoch {capability.get('route_epoch')} is not current ({route_epoch})"
    outside = set(request.get("regions", ())) - set(capability.get("allowed_regions", ()))
    if outside:
        return f"regions {sorted(outside)} outside the capability"
    if not 0 < request.get("bytes", 0) <= capability.get("max_bytes", 0):
        return f"request bytes {request.get('bytes')} outside (0, {capability.get('max_bytes')}]"
    return None
