"""TetriInfer decode placement ledger (spec 0x0DA-0x0DC).

A predicted output-length bucket carries bounds, not a point estimate; the upper bound sizes
the decode reservation. Decode owners are chosen by a power-of-two sample inside the set of
workers with room for that reservation; admission uses a static or a dynamic memory gate.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence


def validate_buckets(boundaries: Sequence[int]) -> None:
    """Boundaries [a_0, a_1, ..., a_G] must start at 0 and strictly increase."""
    if len(boundaries) < 2 or boundaries[0] != 0:
        raise ValueError("bucket boundaries need at least two entries starting at 0")
    if any(b <= a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError("bucket boundaries must strictly increase")


def bucket_of(length_tokens: int, boundaries: Sequence[int]) -> int:
    """g such that a_g <= y < a_{g+1}; lengths past the last bound are an error."""
    validate_buckets(boundaries)
    if not 0 <= length_tokens < boundaries[-1]:
        raise ValueError(f"length {length_tokens} outside [0, {boundaries[-1]})")
    return bisect.bisect_right(boundaries, length_tokens) - 1


def reservation_bounds_bytes(bucket: int, boundaries: Sequence[int], kv_bytes_per_token: int) -> tuple[int, int]:
    """[a_g * B, a_{g+1} * B]; the upper end is the conservative reservation."""
    validate_buckets(boundaries)
    return boundaries[bucket] * kv_bytes_per_token, boundaries[bucket + 1] * kv_bytes_per_token


def prediction_outcome(actual_tokens: int, bucket: int, boundaries: Sequence[int]) -> str:
    """'covered', 'under' (generated past the bucket) or 'over' (stopped below it)."""
    if actual_tokens >= boundaries[bucket + 1]:
        return "under"
    if actual_tokens < boundaries[bucket]:
        return "over"
    return "covered"


@dataclass(frozen=True)
class DecodeWorker:
    name: str
    free_bytes: int
    heavy: int
    light: int


def eligible_decode(workers: Sequence[DecodeWorker], reservation_bytes: int) -> list[DecodeWorker]:
    """The alpha set: workers whose free memory covers the reservation."""
    return [w for w in workers if w.free_bytes >= reservation_bytes]


def heavy_light_ratio_after(worker: DecodeWorker, request_is_heavy: bool) -> float:
    """Heavy-to-light ratio once the request joins; all-heavy counts as infinite."""
    heavy = worker.heavy + (1 if request_is_heavy else 0)
    light = worker.light + (0 if request_is_heavy else 1)
    return heavy / light if light else float("inf")


def power_of_two_choice(left: DecodeWorker, right: DecodeWorker, request_is_heavy: bool) -> DecodeWorker:
    """Of the two sampled workers, the one with the lower ratio after admission (name breaks ties)."""
    return min((left, right), key=lambda w: (heavy_light_ratio_after(w, request_is_heavy), w.name))


def reserve_static_admits(used_bytes: int, new_bytes: int, capacity_bytes: int) -> bool:
    """M_active + R_new <= M_cap."""
    return used_bytes + new_bytes <= capacity_bytes


def reserve_dynamic_admits(used_bytes: int, shortest_release_bytes: int, new_bytes: int, capacity_bytes: int) -> bool:
    """M_active - R_short + R_new <= M_cap: a promise about the next release, not free memory now."""
    return used_bytes - shortest_release_bytes + new_bytes <= capacity_bytes
