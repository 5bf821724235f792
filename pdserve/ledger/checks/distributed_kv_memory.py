"""Check: MemServe memory pool and Mooncake cache-aware routing (spec 0x09A-0x09J).

Covers the identity-seeded prefix hash chain, allocate-to-publish ordering and its failure
path, the four caching milestones (each adds exactly one capability), network-call geometry,
local-vs-remote prefill pricing and early rejection before any prompt work.
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger import kvmemory
from pdserve.ledger.checks.common import expect_equal, expect_rounded, get, integer, ledger_errors, require, require_synthetic

SUCCESS_PATH = ["ALLOCATE", "ADDRESSES", "TRANSMIT", "DEVICE_VISIBLE", "VALIDATE", "INSERT", "PUBLISH", "ACK"]
FAILURE_FORBIDDEN = {"INSERT", "PUBLISH", "ACK"}
MILESTONES = ["PD-Basic", "PD-Caching-1", "PD-Caching-2", "PD-Caching-3"]
CAPABILITIES = ("retains_prefill_history", "publishes_at_decode", "returns_decode_history")


def _prefix_chain(fx: dict) -> list[str]:
    hashes = kvmemory.prefix_hash_chain(get(fx, "prefix_chain.identity", str), get(fx, "prefix_chain.blocks", list))
    require(len(set(hashes)) == len(hashes), "prefix hash chain repeats a key")
    expect_equal("prefix hashes", hashes, get(fx, "prefix_chain.expected_hashes", list))
    return hashes


def _transactions(fx: dict) -> None:
    expect_equal("transfer-with-insert order", get(fx, "transfer_with_insert.success_events", list), SUCCESS_PATH)
    failure = get(fx, "transfer_with_insert.failure_events", list)
    leaked = FAILURE_FORBIDDEN.intersection(failure)
    require(not leaked, f"failed transfer exposes {sorted(leaked)}")
    expect_equal("failure cleanup tail", failure[-2:], ["ABORT_INDEX", "FREE"])


def _milestones(fx: dict) -> None:
    rows = get(fx, "milestones", list)
    expect_equal("milestone names", [m.get("name") for m in rows], MILESTONES)
    for before, after in zip(rows, rows[1:]):
        added = [c for c in CAPABILITIES if after.get(c) and not before.get(c)]
        lost = [c for c in CAPABILITIES if before.get(c) and not after.get(c)]
        require(len(added) == 1 and not lost, f"{after['name']} must add exactly one capability to {before['name']} (added {added}, lost {lost})")


def _geometry(fx: dict) -> dict[str, list[int]]:
    layers = integer(fx, "call_geometry.layers", 1)
    derived = {}
    for mode in kvmemory.CALL_MODES:
        g = kvmemory.call_geometry(layers, mode)
        derived[mode] = [g.api_calls, g.network_transfers]
        expect_equal(f"call geometry {mode}", derived[mode], get(fx, f"call_geometry.expected.{mode}", list))
    return derived


def _costs(fx: dict) -> list[kvmemory.PrefillCost]:
    m = get(fx, "mooncake", dict)
    costs = []
    for c in m["candidates"]:
        cand = kvmemory.PrefillCandidate(c["name"], c["queue_ms"] / 1e3, c["local_prefix_blocks"])
        with ledger_errors():
            cost = kvmemory.prefill_cost(cand, m["request_blocks"], m["best_remote_prefix_blocks"], m["prefill_ms_per_block"] / 1e3, m["transfer_ms_per_block"] / 1e3, m["balance_threshold_blocks"])
        expected = m["expected"]["costs"][c["name"]]
        expect_rounded(f"{c['name']} local_ms", cost.local_s * 1e3, expected["local_ms"], 6)
        remote_ms = None if cost.remote_s is None else round(cost.remote_s * 1e3, 6)
        expect_equal(f"{c['name']} remote_ms", remote_ms, expected["remote_ms"])
        costs.append(cost)
    return costs


def _mooncake(fx: dict) -> dict[str, Any]:
    m = get(fx, "mooncake", dict)
    costs = _costs(fx)
    longest = max(m["candidates"], key=lambda c: c["local_prefix_blocks"])["name"]
    gates = (m["ttft_gate_ms"] / 1e3, m["tbt_gate_ms"] / 1e3)
    decision = kvmemory.route_or_reject(costs, {k: v / 1e3 for k, v in m["decode_tbt_ms"].items()}, *gates)
    overload = kvmemory.route_or_reject(costs, {k: v / 1e3 for k, v in m["overload_decode_tbt_ms"].items()}, *gates)
    chosen = next(c for c in costs if c.name == decision.prefill) if decision.admitted else None
    derived = {
        "longest_prefix": longest,
        "prefill": decision.prefill,
        "path": chosen.path if chosen else None,
        "decode": decision.decode,
        "admitted": decision.admitted,
        "overload_admitted": overload.admitted,
        "overload_prefill_blocks": 0 if not overload.admitted else m["request_blocks"],
    }
    for key, value in derived.items():
        expect_equal(f"mooncake.{key}", value, m["expected"][key])
    return derived


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    hashes = _prefix_chain(fx)
    _transactions(fx)
    _milestones(fx)
    return {"prefix_hashes": hashes, "call_geometry": _geometry(fx), "mooncake": _mooncake(fx)}
