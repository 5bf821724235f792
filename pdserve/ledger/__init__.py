"""Shared serving arithmetic: the one copy of every byte, time and capacity ledger.

Pure functions over plain numbers and frozen dataclasses, no I/O and no torch, so the router,
handoff, planner and the `pdserve ledger` / `pdserve check` commands all compute the same
values. One module per ledger family:

    kv          K/V bytes, handoff compute/transfer sets, logical vs physical bytes
    phase       prefill/decode/mixed work vectors and the roofline lower bound
    queueing    M/D/1 prefill TTFT and its inter/intra-operator forms
    goodput     attainment, phase and two-SLO goodput, replica counts, per-GPU goodput
    placement   model residency, K/V payload demand vs links, low-affinity stage packing
    splitwise   pending-token JSQ, mixed-pool capacity, FCFS batching, layer visibility
    runahead    KV-Runahead partition work and prefix traffic
    tetri       TetriInfer buckets, reservation gates, power-of-two decode choice
    kvmemory    MemServe call geometry, prefix hash chain, Mooncake routing
    margin      net margin for enabling P/D
    transfer    byte credits in flight, overlapped work, exposed stall
    trace       the transfer-trace contract over runtime JSON-lines traces
"""

from pdserve.ledger.goodput import (
    attainment,
    goodput_per_gpu,
    joint_attainment,
    phase_goodput,
    replica_count,
    system_goodput,
    system_goodput_per_gpu,
    two_slo_goodput,
)
from pdserve.ledger.kv import (
    HandoffSets,
    PhysicalTraffic,
    handoff_sets,
    kv_bytes,
    kv_bytes_per_layer_token,
    kv_bytes_per_token,
    logical_transfer_bytes,
    payload_time_s,
    physical_transfer_bytes,
    prefix_handoff_counts,
)
from pdserve.ledger.margin import MarginTerms, net_margin_s, should_enable_pd
from pdserve.ledger.phase import (
    BlockGeometry,
    PhaseWork,
    SlotBounds,
    decode_work,
    lower_bound_s,
    mixed_work,
    prefill_work,
    slot_bounds,
)
from pdserve.ledger.placement import link_feasible, model_residency_bytes, payload_demand_bytes_per_s
from pdserve.ledger.queueing import inter_op_ttft_s, intra_op_ttft_s, md1_ttft_s, md1_wait_s
from pdserve.ledger.transfer import exposed_stall_s, overlapped_work_s, peak_inflight_bytes

__all__ = [
    "BlockGeometry",
    "HandoffSets",
    "MarginTerms",
    "PhaseWork",
    "PhysicalTraffic",
    "SlotBounds",
    "attainment",
    "decode_work",
    "exposed_stall_s",
    "goodput_per_gpu",
    "handoff_sets",
    "inter_op_ttft_s",
    "intra_op_ttft_s",
    "joint_attainment",
    "kv_bytes",
    "kv_bytes_per_layer_token",
    "kv_bytes_per_token",
    "link_feasible",
    "logical_transfer_bytes",
    "lower_bound_s",
    "md1_ttft_s",
    "md1_wait_s",
    "mixed_work",
    "model_residency_bytes",
    "net_margin_s",
    "overlapped_work_s",
    "payload_demand_bytes_per_s",
    "payload_time_s",
    "peak_inflight_bytes",
    "phase_goodput",
    "physical_transfer_bytes",
    "prefill_work",
    "prefix_handoff_counts",
    "replica_count",
    "should_enable_pd",
    "slot_bounds",
    "system_goodput",
    "system_goodput_per_gpu",
    "two_slo_goodput",
]
