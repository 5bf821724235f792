"""Check: KV-Runahead partitions and TetriInfer decode placement (0x0CA-0x0CE, 0x0DA-0x0DE).

KV-Runahead: dense-block and triangular work per process, the closed-form dense total, prefix
traffic vs equal-partition KVR and TSP token rows, searched partitions under the current
profile epoch, the per-layer event order and publication only from the final process.
TetriInfer: contiguous buckets, upper-bound reservation, eligible set, power-of-two choice,
static vs dynamic gates, prediction outcomes, fresh snapshot, request-level transfer.
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger import runahead, tetri
from pdserve.ledger.checks.common import expect_equal, get, integer, ledger_errors, require, require_synthetic

LAYER_EVENTS = ["IRECV_PREFIX", "QKV_PROJECTION", "WAIT_PREFIX", "CONCAT_LOCAL_KV", "ISEND_PREFIX", "CAUSAL_ATTENTION", "LAYER_DONE"]
PUBLISH_ORDER = ["COMPLETE_ALL_LAYERS", "VALIDATE", "PUBLISH", "ADMIT_DECODE"]


def _variant(fx: dict, variant: dict) -> dict[str, Any]:
    name, part = variant["name"], variant["partition"]
    expect_equal(f"{name} rows", sum(part), get(fx, "runahead.context_rows"))
    expect_equal(f"{name} processes", len(part), get(fx, "runahead.processes"))
    if variant.get("searched", False):
        expect_equal(f"{name} profile epoch", variant.get("profile_epoch"), get(fx, "runahead.current_profile_epoch"))
    with ledger_errors():
        dense = runahead.dense_block_work(part)
    derived = {
        "dense": dense,
        "triangular": runahead.triangular_work(part),
        "critical_dense": max(dense),
        "prefix_sums": runahead.prefix_sums_sent(part),
        "traffic_bytes": runahead.kvr_traffic_bytes(part, integer(fx, "runahead.layers", 1), integer(fx, "runahead.kv_bytes_per_layer_token", 1)),
    }
    require(sum(dense) == runahead.dense_block_total(part), f"{name}: dense sum disagrees with (C^2 + sum n^2)/2")
    for key, value in derived.items():
        expect_equal(f"{name}.{key}", value, variant["expected"][key])
    return derived


def _runahead(fx: dict) -> dict[str, Any]:
    rows, procs = integer(fx, "runahead.context_rows", 1), integer(fx, "runahead.processes", 1)
    derived: dict[str, Any] = {v["name"]: _variant(fx, v) for v in get(fx, "runahead.variants", list)}
    derived["equal_kvr_token_rows"] = runahead.kvr_equal_token_rows(rows, procs)
    derived["tsp_token_rows"] = runahead.tsp_token_rows(rows, procs)
    for key in ("equal_kvr_token_rows", "tsp_token_rows"):
        expect_equal(key, derived[key], get(fx, f"runahead.expected.{key}"))
    expect_equal("per-layer event order", get(fx, "runahead.layer_events", list), LAYER_EVENTS)
    expect_equal("complete-cache owner", get(fx, "runahead.publish.from_process"), procs - 1)
    expect_equal("publication order", get(fx, "runahead.publish.order", list), PUBLISH_ORDER)
    return derived


def _tetri_route(fx: dict, bounds: list[int], per_token: int) -> dict[str, Any]:
    snap = get(fx, "tetri.snapshot", dict)
    require(snap["age_ms"] <= snap["max_age_ms"], f"decode snapshot v{snap['version']} is {snap['age_ms']} ms old (limit {snap['max_age_ms']})")
    request = get(fx, "tetri.request", dict)
    with ledger_errors():
        low, high = tetri.reservation_bounds_bytes(request["predicted_bucket"], bounds, per_token)
    workers = [tetri.DecodeWorker(w["name"], w["free_bytes"], w["heavy"], w["light"]) for w in snap["workers"]]
    eligible = tetri.eligible_decode(workers, high)
    by_name = {w.name: w for w in eligible}
    pair = request["sampled_pair"]
    require(all(n in by_name for n in pair), f"sampled pair {pair} is not inside the eligible set {sorted(by_name)}")
    owner = tetri.power_of_two_choice(by_name[pair[0]], by_name[pair[1]], request["heavy"])
    return {"reservation_bytes": [low, high], "eligible": [w.name for w in eligible], "decode_owner": owner.name}


def _tetri(fx: dict) -> dict[str, Any]:
    bounds = get(fx, "tetri.bucket_bounds", list)
    per_token = integer(fx, "tetri.kv_bytes_per_token", 1)
    with ledger_errors():
        tetri.validate_buckets(bounds)
    derived = _tetri_route(fx, bounds, per_token)
    gate = get(fx, "tetri.gate", dict)
    new = derived["reservation_bytes"][1]
    derived["reserve_static"] = tetri.reserve_static_admits(gate["used_bytes"], new, gate["capacity_bytes"])
    derived["reserve_dynamic"] = tetri.reserve_dynamic_admits(gate["used_bytes"], gate["shortest_release_bytes"], new, gate["capacity_bytes"])
    derived["outcomes"] = [tetri.prediction_outcome(c["actual_tokens"], c["bucket"], bounds) for c in get(fx, "tetri.predictions", list)]
    for key, value in derived.items():
        expect_equal(f"tetri.{key}", value, get(fx, f"tetri.expected.{key}"))
    granularity = get(fx, "tetri.transfer_granularity", str)
    require(granularity == "request", f"transfer granularity {granularity!r}: the described system implements request-level transfer")
    return derived


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    return {"runahead": _runahead(fx), "tetri": _tetri(fx)}
