"""Attainment, phase goodput, replica counts and system goodput (spec 0x08C, 0x0A).

Attainment is a fraction of samples meeting a latency gate; goodput is the largest offered
rate (on a fixed grid) whose attainment reaches the target. The system is limited by its
slower phase pool, and per-GPU goodput divides by every GPU in both pools.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence


def attainment(latencies_s: Sequence[float], gate_s: float) -> float:
    """Fraction of samples with latency <= gate; an empty sample set is an error."""
    if not latencies_s:
        raise ValueError("attainment needs at least one sample")
    return sum(1 for x in latencies_s if x <= gate_s) / len(latencies_s)


def joint_attainment(ttft_s: Sequence[float], tpot_s: Sequence[float], ttft_gate_s: float, tpot_gate_s: float) -> float:
    """Fraction of requests passing both clocks; never above either marginal attainment."""
    if len(ttft_s) != len(tpot_s) or not ttft_s:
        raise ValueError("joint attainment needs equal, non-empty per-request samples")
    both = sum(1 for f, o in zip(ttft_s, tpot_s) if f <= ttft_gate_s and o <= tpot_gate_s)
    return both / len(ttft_s)


def phase_goodput(samples_by_rate: Mapping[float, Sequence[float]], gate_s: float, target: float) -> float:
    """max{rate : attainment(rate) >= target}; 0.0 when no grid rate qualifies."""
    passing = [rate for rate, xs in samples_by_rate.items() if attainment(xs, gate_s) >= target]
    return max(passing, default=0.0)


def two_slo_goodput(
    ttft_by_rate: Mapping[float, Sequence[float]],
    tpot_by_rate: Mapping[float, Sequence[float]],
    ttft_gate_s: float,
    tpot_gate_s: float,
    target: float,
) -> float:
    """Largest rate where TTFT attainment and TPOT attainment both reach the target."""
    passing = [
        rate
        for rate in ttft_by_rate
        if rate in tpot_by_rate
        and attainment(ttft_by_rate[rate], ttft_gate_s) >= target
        and attainment(tpot_by_rate[rate], tpot_gate_s) >= target
    ]
    return max(passing, default=0.0)


def goodput_per_gpu(goodput_rps: float, gpus: int) -> float:
    """Selection score for a phase configuration: goodput divided by its GPUs."""
    if gpus <= 0:
        raise ValueError("gpus must be positive")
    return goodput_rps / gpus


def replica_count(target_rps: float, goodput_rps: float) -> int:
    """ceil(target / per-replica goodput)."""
    if goodput_rps <= 0:
        raise ValueError("a configuration with zero goodput cannot reach any target")
    return math.ceil(target_rps / goodput_rps - 1e-12)


def system_goodput(prefill_capacity_rps: float, decode_capacity_rps: float) -> float:
    """The slower phase pool bounds request goodput."""
    return min(prefill_capacity_rps, decode_capacity_rps)


def system_goodput_per_gpu(system_rps: float, prefill_gpus: int, decode_gpus: int) -> float:
    """System goodput over every provisioned GPU in both pools."""
    total = prefill_gpus + decode_gpus
    if total <= 0:
        raise ValueError("a deployment needs at least one GPU")
    return system_rps / total


def best_per_gpu(candidates: Sequence[tuple[str, float, int]]) -> tuple[str, float, int]:
    """(name, goodput_rps, gpus) with the highest goodput per GPU; fewer GPUs, then name, break ties."""
    viable = [c for c in candidates if c[1] > 0]
    if not viable:
        raise ValueError("no candidate configuration reaches the attainment target at any rate")
    return max(viable, key=lambda c: (c[1] / c[2], -c[2], _reverse_key(c[0])))


def _reverse_key(name: str) -> tuple[int, ...]:
    """Sort key that prefers lexicographically smaller names under max()."""
    return tuple(-ord(ch) for ch in name)
