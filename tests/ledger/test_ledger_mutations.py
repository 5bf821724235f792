"""One-field mutations of every shipped fixture: each must be rejected with a specific reason."""

from __future__ import annotations

import pytest
from mutation_tools import DELETE, mutated

from pdserve.ledger.checks import CHECKS, CheckFailed, load_fixture, run_check

GIB, MIB = 1 << 30, 1 << 20

HANDOFF = [
    ("prefill_reusable", ["b0", "b1", "b2", "b3"], "compute_blocks"),
    ("prefill_reusable", ["b1", "b2"], "not a leading prefix"),
    ("decode_visible", [], "transfer_blocks"),
    ("decode_visible", ["b0", "b1"], "transfer_blocks"),
    ("decode_visible", ["b9"], "outside the prompt"),
    ("prompt_blocks.7", "b6", "unique"),
    ("tensor_abi.layers", 8, "logical_bytes"),
    ("tensor_abi.kv_heads", 4, "logical_bytes"),
    ("tensor_abi.head_dim", 16, "logical_bytes"),
    ("tensor_abi.dtype_bytes", 4, "logical_bytes"),
    ("tensor_abi.block_tokens", 8, "token interval length"),
    ("identity.token_interval", [0, 28], "token interval length"),
    ("identity.attempt", 0, "count from 1"),
    ("identity.tenant", "", "identity.tenant is empty"),
    ("model.checkpoint", "", "model.checkpoint is empty"),
    ("transfer.state", "PUBLISHED", "manifest state"),
    ("transfer.destination", "P0", "same worker"),
    ("expected.compute_count", 7, "compute_count"),
    ("expected.transfer_count", 5, "transfer_count"),
    ("expected.logical_bytes", 5120, "logical_bytes"),
    ("evidence", "measured", "evidence label"),
]

PHASE = [
    ("geometry.layers", 5, "kv_bytes_per_token"),
    ("geometry.d_model", 65, "params_per_layer"),
    ("geometry.d_ff", 161, "params_per_layer"),
    ("geometry.q_heads", 4, "params_per_layer"),
    ("geometry.q_heads", 7, "multiple of kv_heads"),
    ("geometry.kv_heads", 4, "params_per_layer"),
    ("geometry.head_dim", 16, "params_per_layer"),
    ("geometry.dtype_bytes", 4, "kv_bytes_per_token"),
    ("prefill.new_rows", 17, "prefill.flops"),
    ("prefill.visible_before", 9, "prefill.flops"),
    ("decode.visible_lengths", [48, 49, 51], "decode.flops"),
    ("decode.visible_lengths", [48, 49], "decode.flops"),
    ("decode.visible_lengths", [0, 49, 50], "visible lengths must be >= 1"),
    ("rates.flops_per_s", 2e12, "prefill.side"),
    ("rates.bytes_per_s", 5e10, "prefill.side"),
    ("expected.prefill.lb_us", 5.514, "prefill.lb_us"),
    ("expected.decode.lb_us", 3.660, "decode.lb_us"),
    ("expected.mixed.lb_us", 6.646, "mixed.lb_us"),
    ("expected.mixed.weight_bytes", 655360, "mixed.weight_bytes"),
    ("expected.decode.side", "compute", "decode.side"),
    ("expected.dilation", 1.815, "dilation"),
]

PROTOCOL = [
    ("transaction.identity.tenant", "tenant-b", "identity.tenant"),
    ("transaction.identity.request", "req-0002", "identity.request"),
    ("transaction.identity.generation", 2, "identity.generation"),
    ("transaction.identity.attempt", 2, "identity.attempt"),
    ("transaction.identity.source_epoch", 6, "identity.source_epoch"),
    ("transaction.identity.destination_epoch", 8, "identity.destination_epoch"),
    ("transaction.identity.reservation", "dres-9-0040", "identity.reservation"),
    ("transaction.transfer_id", "xfer-0002", "transfer_id"),
    ("transaction.tensor_abi_hash", "abi:4l-2h-8d-fp8-b4", "tensor_abi_hash"),
    ("transaction.chunks.2.transfer_id", "xfer-0000", "chunk L1.c0 transfer_id"),
    ("transaction.chunks.5.generation", 2, "chunk L2.c1 generation"),
    ("transaction.chunks.1.chunk_id", "L0.c0", "duplicate chunk ids"),
    ("transaction.chunks.1.chunk_id", "L0.c9", "chunk id set"),
    ("transaction.chunks.7", DELETE, "chunk id set"),
    ("transaction.chunks.4.layer", 7, "outside 0..3"),
    ("transaction.chunks.3.token_start", 8, "layer 1 coverage"),
    ("transaction.chunks.3.token_count", 8, "chunk L1.c1 bytes"),
    ("transaction.chunks.3.bytes", 2048, "chunk L1.c1 bytes"),
    ("transaction.chunks.6.checksum", "sha256:0000000000000000", "chunk L3.c0 checksum"),
    ("transaction.chunks.6.send_ms", 85, "producer gate"),
    ("transaction.layer_ready_ms.3", 90, "producer gate"),
    ("transaction.chunks.0.receive_ms", 19, "receive_ms at 19 precedes send_ms"),
    ("transaction.chunks.0.device_visible_ms", 25, "device_visible_ms at 25 precedes receive_ms"),
    ("transaction.chunks.0.credit_acquire_ms", 21, "send_ms at 20 precedes credit_acquire_ms"),
    ("transaction.chunks.0.credit_release_ms", 26, "chunk L0.c0 credit release"),
    ("transaction.credit_release_event", "RECEIVED", "credit release event"),
    ("manifest.credit_window_bytes", 1024, "byte credits"),
    ("transaction.chunks.2.credit_acquire_ms", 29, "byte credits"),
    ("manifest.reservation_bytes", 4096, "destination reservation"),
    ("manifest.layers", 5, "chunk count"),
    ("manifest.tokens", 48, "coverage ends at token 32"),
    ("manifest.chunk_bytes", 512, "manifest chunk size"),
    ("transaction.validate_ms", 115, "validate_ms at 115 precedes last device-visible chunk"),
    ("transaction.publish_ms", 117, "publish_ms at 117 precedes validate_ms"),
    ("transaction.decode_admit_ms", 119, "decode_admit_ms at 119 precedes publish_ms"),
    ("transaction.source_ack_ms", 120.5, "source_ack_ms at 120.5 precedes decode_admit_ms"),
    ("transaction.states", ["PLANNED", "RESERVED", "TRANSFERRING", "PUBLISHED"], "state path"),
    ("transaction.publications", 2, "publications"),
    ("expected.all_visible_ms", 110, "all_visible_ms"),
    ("expected.last_producer_ready_ms", 80, "last_producer_ready_ms"),
    ("expected.peak_inflight_bytes", 1024, "peak_inflight_bytes"),
    ("evidence", "measured", "evidence label"),
]

DISTSERVE = [
    ("prefill_configs.1.ttft_samples_s.8.0", 0.5, "prefill_goodput_rps"),
    ("decode_configs.1.tpot_samples_s.12.0", 0.2, "decode_goodput_rps"),
    ("slo.attainment", 0.95, "goodput_rps"),
    ("target_rps", 17, "prefill_replicas"),
    ("model_bytes", 200 * GIB, "prefill_config"),
    ("gpu_memory_bytes", 160 * GIB, "prefill_config"),
    ("prefill_configs.1.gpus", 3, "prefill_config"),
    ("kv.tokens", 512, "kv_mib_per_request"),
    ("kv.layers", 32, "kv_mib_per_request"),
    ("links.0.capacity_bytes_per_s", 512 * MIB, "link high-affinity path feasible"),
    ("links.1.feasible", True, "link cross-node path feasible"),
    ("low_affinity.slots.4.node", "node1", "has no decode stage 0"),
    ("low_affinity.gpus_per_node", 2, "uses 3 GPUs of 2"),
    ("low_affinity.intra_node_bytes_per_s", 256 * MIB, "exceeds intra-node path"),
    ("low_affinity.slots.1.stage", 0, "places stages [0, 0]"),
    ("low_affinity.instances.prefill", 3, "low-affinity prefill instances"),
    ("expected.residency_gib", 264, "residency_gib"),
    ("expected.rps_per_gpu", 2.4, "rps_per_gpu"),
    ("expected.demand_mib_per_s", 1024, "demand_mib_per_s"),
    ("expected.gpus", 5, "gpus"),
    ("expected.low_affinity_gpus_per_node", {"node0": 4, "node1": 2}, "GPUs per node"),
]

SPLITWISE = [
    ("routing_cases.0.token_pool.0.kv_free_bytes", 8192, "route 'dedicated pools'"),
    ("routing_cases.0.kv_reservation_bytes", 10000, "route 'dedicated pools'"),
    ("routing_cases.0.prompt_pool.1.pending_tokens", 3200, "route 'dedicated pools'"),
    ("routing_cases.1.spill_threshold_tokens", 5000, "route 'prompt spill to mixed'"),
    ("capacity.borrowed", 0, "capacity.mixed_prompt_side_rps"),
    ("capacity.mixed_rps", 8, "capacity.mixed_prompt_side_rps"),
    ("capacity.token_rps", 5, "capacity.static_rps"),
    ("capacity.borrowed", 3, "cannot borrow"),
    ("capacity.expected.mixed_rps", 12, "capacity.mixed_rps"),
    ("batching.token_cap", 2300, "batching.admitted"),
    ("batching.queue_tokens", [1000, 1100, 600], "batching.admitted"),
    ("batching.expected.residual_tokens", 0, "batching.residual_tokens"),
    ("preemption.age_override_ms", 10, "preemption case 'fresh token'"),
    ("preemption.max_preemptions", 0, "preemption case 'fresh token'"),
    ("preemption.cases.1.age_ms", 100, "preemption case 'aged token'"),
    ("preemption.cases.2.preemptions", 2, "preemption case 'capped token'"),
    ("layer_transfer.ready_ms.2", 80, "layer_transfer.visible_ms"),
    ("layer_transfer.transfer_ms.0", 30, "layer_transfer.visible_ms"),
    ("layer_transfer.expected.serialized_ms", 110, "layer_transfer.serialized_ms"),
    ("layer_transfer.expected.hidden_ms", 0, "layer_transfer.hidden_ms"),
    ("transfer_method.per_layer_threshold_tokens", 200, "transfer method for 256 tokens"),
    ("roles.initial.epoch", 11, "role transition enter_mixed"),
    ("roles.initial.role", "MIXED", "already mixed"),
    ("roles.transitions.1.expected.epoch", 13, "role transition leave_mixed"),
    ("roles.assignments.1.expected", "admit", "assignment req-4"),
]

PIPELINES = [
    ("runahead.variants.1.partition", [40, 30, 26], "KVR-S.dense"),
    ("runahead.variants.1.partition", [40, 32, 20], "KVR-S rows"),
    ("runahead.variants.1.profile_epoch", 4, "KVR-S profile epoch"),
    ("runahead.current_profile_epoch", 6, "KVR-S profile epoch"),
    ("runahead.kv_bytes_per_layer_token", 2048, "KVR-E.traffic_bytes"),
    ("runahead.layers", 8, "KVR-E.traffic_bytes"),
    ("runahead.variants.1.expected.traffic_bytes", 1572864, "KVR-S.traffic_bytes"),
    ("runahead.variants.0.expected.critical_dense", 2304, "KVR-E.critical_dense"),
    ("runahead.variants.2.expected.triangular", [820, 1808, 2304], "KVR-P.triangular"),
    ("runahead.expected.tsp_token_rows", 96, "tsp_token_rows"),
    ("runahead.processes", 4, "KVR-E processes"),
    ("runahead.layer_events.2", "CONCAT_LOCAL_KV", "per-layer event order"),
    ("runahead.publish.from_process", 1, "complete-cache owner"),
    ("runahead.publish.order", ["COMPLETE_ALL_LAYERS", "PUBLISH", "VALIDATE", "ADMIT_DECODE"], "publication order"),
    ("tetri.bucket_bounds", [0, 200, 400, 400, 800], "strictly increase"),
    ("tetri.request.predicted_bucket", 3, "sampled pair"),
    ("tetri.kv_bytes_per_token", 2048, "sampled pair"),
    ("tetri.snapshot.workers.1.free_bytes", 600000, "sampled pair"),
    ("tetri.request.heavy", False, "tetri.decode_owner"),
    ("tetri.snapshot.workers.2.light", 3, "tetri.decode_owner"),
    ("tetri.snapshot.age_ms", 80, "ms old"),
    ("tetri.gate.used_bytes", 400000, "tetri.reserve_static"),
    ("tetri.gate.shortest_release_bytes", 100000, "tetri.reserve_dynamic"),
    ("tetri.predictions.1.actual_tokens", 599, "tetri.outcomes"),
    ("tetri.transfer_granularity", "chunk", "request-level"),
]

KV_MEMORY = [
    ("prefix_chain.identity", "toy-4l-64d|rope-base-500000|bf16|abi:4l-2h-8d-bf16-b4", "prefix hashes"),
    ("prefix_chain.blocks.1.0", 14, "prefix hashes"),
    ("prefix_chain.expected_hashes.0", "0" * 64, "prefix hashes"),
    ("transfer_with_insert.success_events", ["ALLOCATE", "ADDRESSES", "TRANSMIT", "DEVICE_VISIBLE", "VALIDATE", "PUBLISH", "INSERT", "ACK"], "transfer-with-insert order"),
    ("transfer_with_insert.success_events", ["ALLOCATE", "ADDRESSES", "TRANSMIT", "VALIDATE", "INSERT", "PUBLISH", "ACK"], "transfer-with-insert order"),
    ("transfer_with_insert.failure_events", ["ALLOCATE", "ADDRESSES", "TRANSMIT", "PUBLISH", "ABORT_INDEX", "FREE"], "exposes"),
    ("transfer_with_insert.failure_events", ["ALLOCATE", "ADDRESSES", "TRANSMIT", "ABORT_INDEX"], "failure cleanup tail"),
    ("milestones.2.returns_decode_history", True, "exactly one capability"),
    ("milestones.1.name", "PD-Caching-2", "milestone names"),
    ("call_geometry.layers", 8, "call geometry discrete"),
    ("call_geometry.expected.batched", [1, 1], "call geometry batched"),
    ("mooncake.candidates.2.queue_ms", 5, "P2 local_ms"),
    ("mooncake.candidates.1.queue_ms", 55, "P1 local_ms"),
    ("mooncake.transfer_ms_per_block", 20, "P0 remote_ms"),
    ("mooncake.balance_threshold_blocks", 7, "P1 remote_ms"),
    ("mooncake.decode_tbt_ms.D0", 105, "mooncake.decode"),
    ("mooncake.overload_decode_tbt_ms.D0", 99, "mooncake.overload_admitted"),
    ("mooncake.tbt_gate_ms", 130, "mooncake.overload_admitted"),
    ("mooncake.ttft_gate_ms", 20, "mooncake.prefill"),
    ("mooncake.expected.longest_prefix", "P1", "mooncake.longest_prefix"),
]

TRACE = [
    ("events.13.generation", 4, "mixes identities"),
    ("events.10.request", "req-0002", "mixes identities"),
    ("events.13.event", "chunk_receive", "layers [1] not visible"),
    ("events.13.ts", 0.000205, "layers [1] not visible"),
    ("events.14.ts", 0.000210, "without a prior validate"),
    ("events.16.ts", 0.000190, "acknowledged before publication"),
    ("events.8.ts", 0.000095, "before layer 1 was ready"),
    ("events.16.event", "publish", "published 2 times"),
    ("events.16.event", "abort", "aborted transaction was published"),
    ("events.15.transfer", "xfer-0002", "holds 2 transactions"),
    ("events.4.event", "chunk_receive", "overlapped_us"),
    ("expected.retries", 0, "retries"),
    ("events.11.ts", 0.000150, "exposed_stall_us"),
    ("events.16.ts", 0.000230, "wall_us"),
    ("events.10.bytes", 1048576, "logical_bytes"),
    ("events.3.bytes", 1048576, "sent_bytes"),
    ("expected_layers", [0, 1, 2], "layers [2] not visible"),
    ("events.3.event", "bogus", "unknown event"),
    ("events.2.ts", "soon", "line 3"),
    ("events.11.event", "layer_ready", "no decode_ready"),
]

RELEASE = [
    ("source_pins.0.commit", "abc", "commit is not a 40-hex"),
    ("source_paths.0.pin", "sglang", "unknown pin"),
    ("source_paths.1.blob", "not-a-blob", "no 40-hex blob id"),
    ("connector.direction", "both", "push or pull"),
    ("connector.producer_role", "decode", "connector roles"),
    ("capability.route_epoch", 20, "route epoch"),
    ("capability.allowed_regions", ["d0:r12"], "outside the capability"),
    ("capability.expires_at_s", 1100, "lifetime"),
    ("capability.issuer", "rogue", "trusted control plane"),
    ("capability.max_bytes", 4096, "request bytes"),
    ("capability.cache_abi", "abi:other", "cache_abi"),
    ("denied_probes.0.change", {"regions": ["d0:r13"]}, "was allowed"),
    ("denied_probes.1.reason_contains", "tenant", "denied for"),
    ("sensitivity.promoted_cell", "long-prompt/low-bw", "does not clear"),
    ("sensitivity.cells.1.transfer_exposed_ms", 8, "long-prompt/low-bw margin_ms"),
    ("sensitivity.cells.0.tpot_gate", False, "long-prompt/high-bw enable"),
    ("sensitivity.safety_margin_ms", 40, "long-prompt/high-bw enable"),
    ("gates.stale_publications", 1, "gate stale_publications"),
    ("gates.canary_samples", 10, "canary samples"),
    ("gates.tpot_attainment", 0.8, "tpot_attainment"),
    ("gates.rollback_drill_passed", False, "rollback_drill_passed"),
    ("failure_outcomes.0.outcome", "PUBLISH_PARTIAL", "failure outcomes"),
    ("observability", ["pd_route_total", "kv_transfer_bytes"], "observability lacks"),
    ("release_states", ["PINNED", "SHADOW", "ACTIVE", "ROLLING_BACK", "ROLLED_BACK"], "illegal release transition SHADOW -> ACTIVE"),
    ("release_states.5", "ACTIVE", "illegal release transition ROLLING_BACK -> ACTIVE"),
    ("rollback_steps.3", "DISABLE_CONNECTOR", "rollback step 4"),
    ("rollback_steps.0", "ADVANCE_ROUTE_EPOCH", "rollback step 1"),
    ("rollback_steps.6", "ROLLBACK_COMPLETE", "rollback step 7"),
    ("expected.final_state", "ACTIVE", "final_state"),
]

TABLE = {
    "handoff-manifest": HANDOFF,
    "phase-cost": PHASE,
    "transfer-protocol": PROTOCOL,
    "distserve-placement": DISTSERVE,
    "splitwise-pools": SPLITWISE,
    "alternative-pipelines": PIPELINES,
    "distributed-kv-memory": KV_MEMORY,
    "transfer-trace": TRACE,
    "runtime-release": RELEASE,
}

CASES = [(name, path, value, reason) for name, rows in TABLE.items() for path, value, reason in rows]


def test_every_check_has_mutations():
    assert set(TABLE) == set(CHECKS)
    assert all(len(rows) >= 10 for rows in TABLE.values())
    assert len(PROTOCOL) >= 24


@pytest.mark.parametrize("name,path,value,reason", CASES, ids=[f"{c[0]}:{c[1]}={c[2]!r}"[:90] for c in CASES])
def test_one_field_mutation_is_rejected(name, path, value, reason):
    fixture = mutated(load_fixture(name), path, value)
    with pytest.raises(CheckFailed) as failure:
        run_check(name, fixture)
    assert reason in str(failure.value)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_fixture_for_another_check_is_rejected(name):
    fixture = mutated(load_fixture(name), "check", "something-else")
    with pytest.raises(CheckFailed, match="fixture is for check"):
        run_check(name, fixture)
