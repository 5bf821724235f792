"""KV-Runahead partition work and prefix traffic (spec 0x0CA-0x0CB).

Process p owns n_p consecutive prompt rows after C_p = sum of earlier rows. Dense-block work
(masked square local block) is n_p*C_p + n_p^2; exact triangular work is n_p*C_p + n_p(n_p+1)/2.
Link p -> p+1 carries the prefix S_p = sum_{j<=p} n_j; tensor/sequence parallelism with
equal shares instead all-gathers (P-1)*C token entries.
"""

from __future__ import annotations

from typing import Sequence


def _validate(partition: Sequence[int]) -> None:
    if not partition or any(n <= 0 for n in partition):
        raise ValueError("a partition needs at least one process and positive row counts")


def earlier_rows(partition: Sequence[int]) -> list[int]:
    """C_p for every process."""
    _validate(partition)
    out, total = [], 0
    for rows in partition:
        out.append(total)
        total += rows
    return out


def dense_block_work(partition: Sequence[int]) -> list[int]:
    """Per-process score entries with a dense local diagonal block."""
    return [n * c + n * n for n, c in zip(partition, earlier_rows(partition))]


def triangular_work(partition: Sequence[int]) -> list[int]:
    """Per-process valid causal pairs only."""
    return [n * c + n * (n + 1) // 2 for n, c in zip(partition, earlier_rows(partition))]


def dense_block_total(partition: Sequence[int]) -> int:
    """Closed form (C^2 + sum n_p^2) / 2; equals sum(dense_block_work(partition))."""
    _validate(partition)
    total = sum(partition)
    return (total * total + sum(n * n for n in partition)) // 2


def prefix_sums_sent(partition: Sequence[int]) -> list[int]:
    """S_0..S_{P-2}: rows carried by each forward link."""
    _validate(partition)
    out, total = [], 0
    for rows in partition[:-1]:
        total += rows
        out.append(total)
    return out


def kvr_traffic_bytes(partition: Sequence[int], layers: int, kv_bytes_per_layer_token: int) -> int:
    """B_KVR = L * (2 H_kv d_h b) * sum S_i; headers and packing copies excluded."""
    return layers * kv_bytes_per_layer_token * sum(prefix_sums_sent(partition))


def kvr_equal_token_rows(context_rows: int, processes: int) -> float:
    """Equal-partition KV-Runahead traffic in token entries: (P-1) * C / 2."""
    if processes <= 0:
        raise ValueError("processes must be positive")
    return (processes - 1) * context_rows / 2


def tsp_token_rows(context_rows: int, processes: int) -> int:
    """Equal-partition tensor/sequence-parallel all-gather traffic: (P-1) * C."""
    if processes <= 0:
        raise ValueError("processes must be positive")
    return (processes - 1) * context_rows


def equal_partition(context_rows: int, processes: int) -> list[int]:
    """Split C rows over P processes as evenly as possible, earlier processes taking extras."""
    base, extra = divmod(context_rows, processes)
    return [base + (1 if p < extra else 0) for p in range(processes)]
