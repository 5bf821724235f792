"""Prefill TTFT under M/D/1 queueing and its two-way parallel forms (spec 0x08B).

All functions take an arrival rate in requests/s and a deterministic service time in seconds
and raise ValueError when the queue would be unstable (utilization >= 1).
"""

from __future__ import annotations


def _check(rate_per_s: float, service_s: float) -> None:
    if rate_per_s < 0 or service_s <= 0:
        raise ValueError("rate must be >= 0 and service time > 0")


def md1_wait_s(rate_per_s: float, service_s: float) -> float:
    """Pollaczek-Khinchine queueing delay for deterministic service: R*D^2 / (2(1 - R*D))."""
    _check(rate_per_s, service_s)
    rho = rate_per_s * service_s
    if rho >= 1:
        raise ValueError(f"unstable queue: utilization {rho:.3f} >= 1")
    return rate_per_s * service_s**2 / (2 * (1 - rho))


def md1_ttft_s(rate_per_s: float, service_s: float) -> float:
    """Average TTFT of one prefill device: service plus M/D/1 wait."""
    return service_s + md1_wait_s(rate_per_s, service_s)


def inter_op_ttft_s(rate_per_s: float, service_s: float) -> float:
    """Two-stage pipeline: latency stays ~D, the slowest stage serves every D/2.

    D + R*D^2 / (4(2 - R*D)); stable while R*D < 2.
    """
    _check(rate_per_s, service_s)
    load = rate_per_s * service_s
    if load >= 2:
        raise ValueError(f"unstable two-stage pipeline: R*D = {load:.3f} >= 2")
    return service_s + rate_per_s * service_s**2 / (4 * (2 - load))


def intra_op_ttft_s(rate_per_s: float, service_s: float, speedup: float) -> float:
    """Two-way intra-operator split with speedup K in (1, 2]: D/K + R*D^2 / (2K(K - R*D))."""
    _check(rate_per_s, service_s)
    if not 1 < speedup <= 2:
        raise ValueError(f"speedup must be in (1, 2], got {speedup}")
    load = rate_per_s * service_s
    if load >= speedup:
        raise ValueError(f"unstable queue: R*D = {load:.3f} >= K = {speedup}")
    return service_s / speedup + rate_per_s * service_s**2 / (2 * speedup * (speedup - load))
