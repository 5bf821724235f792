"""Every shipped fixture passes, and reproduces the spec's worked numbers exactly."""

from __future__ import annotations

import json

import pytest

from pdserve.ledger.checks import CHECKS, load_fixture, run_check


def derive(name: str) -> dict:
    return run_check(name, load_fixture(name))


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_shipped_fixture_passes_and_is_synthetic(name):
    fixture = load_fixture(name)
    assert fixture["check"] == name and fixture["evidence"] == "synthetic"
    json.dumps(derive(name), default=str)


def test_handoff_manifest_numbers():
    d = derive("handoff-manifest")
    assert d["compute_blocks"] == ["b3", "b4", "b5", "b6", "b7"]
    assert d["transfer_blocks"] == ["b1", "b2", "b3", "b4", "b5", "b6", "b7"]
    assert (d["compute_count"], d["transfer_count"], d["logical_bytes"]) == (5, 7, 7168)


def test_phase_cost_numbers():
    d = derive("phase-cost")
    assert round(d["prefill"]["lb_us"], 3) == 5.513 and d["prefill"]["side"] == "compute"
    assert round(d["decode"]["lb_us"], 3) == 3.661 and d["decode"]["side"] == "bytes"
    assert round(d["mixed"]["lb_us"], 3) == 6.647
    assert round(d["dilation"], 3) == 1.816


def test_transfer_protocol_numbers():
    d = derive("transfer-protocol")
    assert d["chunks"] == 8 and d["total_bytes"] == 8 * 1024
    assert d["peak_inflight_bytes"] == 2048
    assert (d["last_producer_ready_ms"], d["all_visible_ms"], d["validate_ms"], d["publish_ms"]) == (86, 116, 118, 120)


def test_distserve_numbers():
    d = derive("distserve-placement")
    assert (d["prefill_replicas"], d["decode_replicas"], d["gpus"]) == (2, 1, 6)
    assert (d["prefill_capacity_rps"], d["decode_capacity_rps"], d["system_rps"]) == (16, 12, 12)
    assert d["rps_per_gpu"] == 2
    assert d["residency_gib"] == 396
    assert d["kv_mib_per_request"] == 64 and d["demand_mib_per_s"] == 768
    assert d["low_affinity_gpus_per_node"] == {"node0": 3, "node1": 3}
    links = {link["name"]: link["feasible"] for link in load_fixture("distserve-placement")["links"]}
    assert links == {"high-affinity path": True, "cross-node path": False}


def test_splitwise_numbers():
    d = derive("splitwise-pools")
    assert d["capacity"]["static_rps"] == 8 and d["capacity"]["mixed_rps"] == 10
    assert d["batching"]["admitted"] == 2 and d["batching"]["admitted_tokens"] == 1700
    assert d["layer_transfer"]["visible_ms"] == [35, 60, 85, 110]
    assert d["layer_transfer"]["serialized_ms"] == 140
    assert d["preemption"] == ["prompt", "token", "token"]
    assert [r["epoch"] for r in d["roles"]] == [13, 14]


def test_runahead_numbers():
    d = derive("alternative-pipelines")["runahead"]
    assert d["KVR-S"]["prefix_sums"] == [40, 72]
    assert d["KVR-S"]["traffic_bytes"] == 1_835_008
    assert d["equal_kvr_token_rows"] == 96 and d["tsp_token_rows"] == 192


def test_mooncake_numbers():
    d = derive("distributed-kv-memory")
    m = d["mooncake"]
    assert m["longest_prefix"] == "P2" and m["prefill"] == "P1"
    assert m["decode"] == "D0" and m["admitted"] is True
    assert m["overload_admitted"] is False and m["overload_prefill_blocks"] == 0
    assert d["call_geometry"] == {"discrete": [8, 8], "batched": [1, 8], "aggregated": [1, 1]}


def test_transfer_trace_numbers():
    d = derive("transfer-trace")
    assert d["logical_bytes"] == 8 * 1024 * 1024 and d["retries"] == 1
    assert round(d["wall_us"], 3) == 220 and round(d["overlapped_us"], 3) == 74
    assert round(d["exposed_stall_us"], 3) == 60


def test_release_reaches_rolled_back_in_exact_order():
    d = derive("runtime-release")
    assert d["final_state"] == "ROLLED_BACK"
    assert load_fixture("runtime-release")["rollback_steps"] == [
        "STOP_NEW_ROUTES",
        "ADVANCE_ROUTE_EPOCH",
        "DRAIN_OR_ABORT_TRANSFERS",
        "ENABLE_COLOCATED_FALLBACK",
        "DISABLE_CONNECTOR",
        "REVOKE_CAPABILITIES",
        "RECLAIM_UNPUBLISHED",
        "ROLLBACK_COMPLETE",
    ]
