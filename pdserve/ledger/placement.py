"""Placement resource ledger: residency, K/V payload demand, links, stage packing (0x08C-0x08D).

Low node affinity pairs prefill stage j with decode stage j on one node so their K/V handoff
stays on the intra-node path; `stage_packing_violations` lists every way a layout breaks that.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


def model_residency_bytes(instances: int, model_bytes: int) -> int:
    """Every instance (prefill or decode) holds one complete model copy."""
    if instances < 0 or model_bytes < 0:
        raise ValueError("instances and model bytes must be >= 0")
    return instances * model_bytes


def fits_on_gpus(model_bytes: int, gpus_per_instance: int, gpu_memory_bytes: int) -> bool:
    """Weights sharded evenly over an instance's GPUs fit in each GPU's memory."""
    if gpus_per_instance <= 0:
        raise ValueError("gpus_per_instance must be positive")
    return model_bytes <= gpus_per_instance * gpu_memory_bytes


def payload_demand_bytes_per_s(system_rps: float, kv_bytes_per_request: int) -> float:
    """Minimum logical K/V payload rate the handoff path must carry."""
    return system_rps * kv_bytes_per_request


def link_feasible(demand_bytes_per_s: float, capacity_bytes_per_s: float) -> bool:
    """A path is feasible when its payload capacity covers the logical demand."""
    return demand_bytes_per_s <= capacity_bytes_per_s


@dataclass(frozen=True)
class StageSlot:
    """One pipeline stage of one instance placed on one node."""

    instance: str
    phase: str  # "prefill" | "decode"
    stage: int
    node: str
    gpus: int = 1


def node_gpu_usage(slots: Sequence[StageSlot]) -> dict[str, int]:
    usage: Counter[str] = Counter()
    for slot in slots:
        usage[slot.node] += slot.gpus
    return dict(usage)


def stage_packing_violations(
    slots: Sequence[StageSlot], stages: int, gpus_per_node: int
) -> list[str]:
    """Reasons a low-affinity layout is not placeable; empty when it is.

    Every instance must place stages 0..stages-1 exactly once, each node must stay within its
    GPUs, and every prefill stage must share a node with the decode stage of the same index.
    """
    problems: list[str] = []
    by_instance: dict[str, list[int]] = {}
    for slot in slots:
        by_instance.setdefault(slot.instance, []).append(slot.stage)
    for instance, got in sorted(by_instance.items()):
        if len(got) != stages or sorted(got) != list(range(stages)):
            problems.append(f"instance {instance} places stages {sorted(got)}, expected 0..{stages - 1}")
    for node, used in sorted(node_gpu_usage(slots).items()):
        if used > gpus_per_node:
            problems.append(f"node {node} uses {used} GPUs of {gpus_per_node}")
    decode_nodes = {(s.stage, s.node) for s in slots if s.phase == "decode"}
    for slot in slots:
        if slot.phase == "prefill" and (slot.stage, slot.node) not in decode_nodes:
            problems.append(f"prefill {slot.instance} stage {slot.stage} on {slot.node} has no decode stage {slot.stage} there")
    return problems
