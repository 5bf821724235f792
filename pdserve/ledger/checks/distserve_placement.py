"""Check: DistServe-style phase selection, replica counts, residency and topology (0x08B-0x08D).

Derivation: per-configuration goodput from attainment samples on a rate grid, the fitting
configuration with the best goodput per GPU for each phase, ceil(target / goodput) replicas,
system goodput = slower pool, per-GPU goodput over both pools, one model copy per instance,
K/V payload demand vs each link, and a low-affinity stage layout that must be placeable.
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger.checks.common import (
    expect_equal,
    expect_rounded,
    get,
    integer,
    ledger_errors,
    number,
    require,
    require_synthetic,
)
from pdserve.ledger.goodput import best_per_gpu, phase_goodput, replica_count, system_goodput, system_goodput_per_gpu
from pdserve.ledger.kv import kv_bytes
from pdserve.ledger.placement import (
    StageSlot,
    fits_on_gpus,
    link_feasible,
    model_residency_bytes,
    node_gpu_usage,
    payload_demand_bytes_per_s,
    stage_packing_violations,
)

GIB, MIB = 1 << 30, 1 << 20


def _samples(config: dict, key: str, grid: list[float]) -> dict[float, list[float]]:
    table = config.get(key)
    require(isinstance(table, dict), f"config {config.get('name')} has no {key}")
    expect_equal(f"config {config['name']} rate grid", sorted(float(r) for r in table), sorted(float(r) for r in grid))
    return {float(rate): xs for rate, xs in table.items()}


def _select(fx: dict, phase: str, sample_key: str, gate_s: float) -> tuple[str, float, int]:
    grid, target = get(fx, "rate_grid_rps", list), number(fx, "slo.attainment")
    model_bytes, gpu_bytes = integer(fx, "model_bytes", 1), integer(fx, "gpu_memory_bytes", 1)
    candidates = []
    for config in get(fx, f"{phase}_configs", list):
        gpus = config.get("gpus", 0)
        require(isinstance(gpus, int) and gpus > 0, f"config {config.get('name')} needs a positive GPU count")
        goodput = phase_goodput(_samples(config, sample_key, grid), gate_s, target)
        if fits_on_gpus(model_bytes, gpus, gpu_bytes):
            candidates.append((config["name"], goodput, gpus))
    with ledger_errors():
        return best_per_gpu(candidates)


def _low_affinity(fx: dict, demand: float) -> dict[str, int]:
    stages = integer(fx, "low_affinity.stages", 1)
    slots = [StageSlot(s["instance"], s["phase"], s["stage"], s["node"]) for s in get(fx, "low_affinity.slots", list)]
    problems = stage_packing_violations(slots, stages, integer(fx, "low_affinity.gpus_per_node", 1))
    require(not problems, "low-affinity layout: " + "; ".join(problems))
    require(fits_on_gpus(get(fx, "model_bytes"), stages, get(fx, "gpu_memory_bytes")), "low-affinity stage does not fit on one GPU")
    per_node = demand / stages
    link = number(fx, "low_affinity.intra_node_bytes_per_s", 0)
    require(link_feasible(per_node, link), f"low-affinity: per-node demand {per_node:.0f} B/s exceeds intra-node path {link:.0f} B/s")
    return node_gpu_usage(slots)


def _check_instances(fx: dict, derived: dict) -> None:
    instances = get(fx, "low_affinity.instances", dict)
    expect_equal("low-affinity prefill instances", instances.get("prefill"), derived["prefill_replicas"])
    expect_equal("low-affinity decode instances", instances.get("decode"), derived["decode_replicas"])


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    target_rps = number(fx, "target_rps", 0)
    prefill = _select(fx, "prefill", "ttft_samples_s", number(fx, "slo.ttft_s", 0))
    decode = _select(fx, "decode", "tpot_samples_s", number(fx, "slo.tpot_s", 0))
    n_p, n_d = replica_count(target_rps, prefill[1]), replica_count(target_rps, decode[1])
    system = system_goodput(n_p * prefill[1], n_d * decode[1])
    gpus = n_p * prefill[2] + n_d * decode[2]
    kv = {k: integer(fx, f"kv.{k}", 1) for k in ("tokens", "layers", "kv_heads", "head_dim", "dtype_bytes")}
    request_bytes = kv_bytes(kv["tokens"], kv["layers"], kv["kv_heads"], kv["head_dim"], kv["dtype_bytes"])
    demand = payload_demand_bytes_per_s(system, request_bytes)
    derived = {
        "prefill_config": prefill[0], "decode_config": decode[0],
        "prefill_goodput_rps": prefill[1], "decode_goodput_rps": decode[1],
        "prefill_replicas": n_p, "decode_replicas": n_d,
        "prefill_capacity_rps": n_p * prefill[1], "decode_capacity_rps": n_d * decode[1],
        "system_rps": system, "gpus": gpus,
        "rps_per_gpu": system_goodput_per_gpu(system, n_p * prefill[2], n_d * decode[2]),
        "residency_gib": model_residency_bytes(n_p + n_d, get(fx, "model_bytes")) / GIB,
        "kv_mib_per_request": request_bytes / MIB,
        "demand_mib_per_s": demand / MIB,
    }
    for key, value in derived.items():
        expected = get(fx, f"expected.{key}")
        if isinstance(value, str):
            expect_equal(key, value, expected)
        else:
            expect_rounded(key, value, expected, 3)
    for link in get(fx, "links", list):
        feasible = link_feasible(demand, link.get("capacity_bytes_per_s", 0))
        expect_equal(f"link {link.get('name')} feasible", feasible, link.get("feasible"))
    _check_instances(fx, derived)
    usage = _low_affinity(fx, demand)
    expect_equal("low-affinity GPUs per node", usage, get(fx, "expected.low_affinity_gpus_per_node", dict))
    derived["low_affinity_gpus_per_node"] = usage
    return derived
