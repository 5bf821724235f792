"""Transfer timing ledger: byte credits in flight and overlapped work (spec 0x06B-0x06C, trace).

A chunk holds its byte credit over the half-open interval [acquire, release); the release
event is DEVICE_VISIBLE. Work spans are closed intervals [start, end] in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class CreditHold:
    acquire_s: float
    release_s: float
    nbytes: int


def peak_inflight_bytes(holds: Sequence[CreditHold]) -> int:
    """max over t of the bytes whose hold covers t; a release at t frees before an acquire at t."""
    events = []
    for hold in holds:
        if hold.release_s < hold.acquire_s:
            raise ValueError("a credit cannot be released before it is acquired")
        events.append((hold.acquire_s, 1, hold.nbytes))
        events.append((hold.release_s, 0, -hold.nbytes))
    level = peak = 0
    for _, _, delta in sorted(events):
        level += delta
        peak = max(peak, level)
    return peak


def union_length_s(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of closed intervals."""
    total, end = 0.0, None
    start_cur = None
    for start, stop in sorted(spans):
        if stop < start:
            raise ValueError("a span cannot end before it starts")
        if end is None or start > end:
            if end is not None:
                total += end - start_cur
            start_cur, end = start, stop
        else:
            end = max(end, stop)
    if end is not None:
        total += end - start_cur
    return total


def overlapped_work_s(spans: Sequence[tuple[float, float]]) -> float:
    """Work that ran concurrently with other work: sum of span lengths minus their union."""
    return sum(stop - start for start, stop in spans) - union_length_s(spans)


def exposed_stall_s(publish_end_s: float, decode_ready_s: float) -> float:
    """max(0, publish_end - decode_ready): how long a ready decode waited on publication."""
    return max(0.0, publish_end_s - decode_ready_s)
