"""One source address space over several K/V pools of the same block geometry (issue 19, part 4).

Contract: a prefix fetch may read a holder's device pool and its host tier's pool (two shared-
memory segments) in one transfer. A plan and a capability name each source block as a
(segment, slot) pair; inside a transfer it travels as one integer address: segment i's slot s is
`bases[i] + s`, with one unused address between consecutive segments, so a run of consecutive
addresses (kvbytes.block_runs) never spans two segments. `SourceSegments` indexes like a pool's
uint8 view (kvbytes.pool_bytes, [L, 2, N, B, H_kv, D * dtype_bytes]) for the keys the transports
use, `[layer, kv, start:stop]`, `[layer, :, start:stop]` (the run inside one segment) and
`[layer, kv, address]`,
so checksums, pull copies, TCP sends and staging read host slots in place: zero copies
beyond the transport's own. `valid(address)` is False for a gap or an address past the end.
"""

from __future__ import annotations

import numpy as np


class SourceSegments:
    def __init__(self, raws: list[np.ndarray], names: list[str | None] | None = None):
        if not raws or any(r.shape[:2] != raws[0].shape[:2] or r.shape[3:] != raws[0].shape[3:] for r in raws):
            raise ValueError("source segments must share one block geometry")
        self.raws = list(raws)  # each [L, 2, N_i, B, H_kv, D * dtype_bytes] uint8
        self.names = list(names) if names is not None else [None] * len(raws)
        self.bases: list[int] = []
        end = 0
        for raw in raws:
            self.bases.append(end)
            end += raw.shape[2] + 1  # one unused address after each segment
        first = raws[0]
        self.shape = (first.shape[0], 2, end - 1) + first.shape[3:]

    def address(self, segment: int, slot: int) -> int:
        if not 0 <= slot < self.raws[segment].shape[2]:
            raise ValueError(f"slot {slot} outside segment {segment} ({self.raws[segment].shape[2]} slots)")
        return self.bases[segment] + slot

    def locate(self, address: int) -> tuple[int, int] | None:
        """(segment, slot) of an address; None for a gap or out of range."""
        for i in range(len(self.raws) - 1, -1, -1):
            if address >= self.bases[i]:
                slot = address - self.bases[i]
                return (i, slot) if slot < self.raws[i].shape[2] else None
        return None

    def valid(self, address: int) -> bool:
        return self.locate(address) is not None

    def __getitem__(self, key):
        layer, kv, run = key
        if isinstance(run, (int, np.integer)):  # one block
            where = self.locate(int(run))
            if where is None:
                raise IndexError(f"address {run} names no slot")
            return self.raws[where[0]][layer, kv, where[1]]
        if not isinstance(run, slice) or run.step not in (None, 1):
            raise TypeError(f"source segments take one run of addresses, got {run!r}")
        start, stop = run.start or 0, run.stop
        where = self.locate(start)
        if where is None or stop <= start or self.locate(stop - 1) != (where[0], where[1] + stop - 1 - start):
            raise IndexError(f"addresses {start}:{stop} are not one run inside one segment")
        segment, slot = where
        return self.raws[segment][layer, kv, slot : slot + stop - start]
