"""A seeded fault-injecting wrapper around any `SenderLink` (tests only; never in the package).

Faults, each drawn per frame from one `random.Random(seed)`: drop, delay (held and released
after later frames, which also reorders), duplicate, corrupt (one byte of a chunk's payload is
flipped on the way) and kill (the link dies after `kill_after` frames).
`stage` is deliberately not forwarded, so every chunk's bytes move inside `send_chunk`, where the
faults act: over shm a delayed or duplicated chunk is a late write into staging, never the pool.
Over a pull link no bytes travel, so corruption there is a chunk naming a wrong source block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np

from pdserve.handoff.frames import ChunkFrame, Frame
from pdserve.handoff.kvbytes import chunk_views
from pdserve.handoff.transports.base import ChunkPayload, LinkClosed, SenderLink
from pdserve.handoff.transports.pull import ShmPullSenderLink


@dataclass(frozen=True)
class FaultPlan:
    seed: int = 0
    drop: float = 0.0
    delay: float = 0.0
    duplicate: float = 0.0
    corrupt: float = 0.0
    kill_after: int | None = None


class FaultySenderLink(SenderLink):
    def __init__(self, inner: SenderLink, plan: FaultPlan):
        super().__init__()
        self.inner, self.plan = inner, plan
        self.rng = random.Random(plan.seed)
        self.held: list[tuple[Frame, ChunkPayload | None]] = []
        self.num_frames = 0
        self.injected: dict[str, int] = {}
        self.traffic = inner.traffic
        self.pulls = isinstance(inner, ShmPullSenderLink)  # the destination reads the source pool itself

    def _count(self, fault: str) -> None:
        self.injected[fault] = self.injected.get(fault, 0) + 1

    def _maybe_kill(self) -> None:
        self.num_frames += 1
        if self.plan.kill_after is not None and self.num_frames > self.plan.kill_after:
            self._count("kill")
            self.inner.close()
            raise LinkClosed("killed by fault plan")

    def _emit(self, frame: Frame, payload: ChunkPayload | None) -> None:
        if payload is None:
            self.inner.send(frame)
        else:
            self.inner.send_chunk(frame, payload)

    def _route(self, frame: Frame, payload: ChunkPayload | None) -> None:
        self._maybe_kill()
        roll = self.rng.random
        if roll() < self.plan.drop:
            self._count("drop")
            return
        if roll() < self.plan.delay:
            self._count("delay")
            self.held.append((frame, payload))
            return
        if payload is not None and roll() < self.plan.corrupt:
            self._count("corrupt")
            payload = _misread(payload, self.rng) if self.pulls else _corrupted(payload, self.rng)
        self._emit(frame, payload)
        if roll() < self.plan.duplicate:
            self._count("duplicate")
            self._emit(frame, payload)
        self._release_held()

    def _release_held(self) -> None:
        while self.held and self.rng.random() < 0.5:
            self._emit(*self.held.pop(self.rng.randrange(len(self.held))))

    def send(self, frame: Frame) -> None:
        self._route(frame, None)

    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None:
        self._route(frame, payload)

    def recv(self, timeout_s: float) -> Frame | None:
        if self.held and self.rng.random() < 0.3:
            self._emit(*self.held.pop(0))
        return self.inner.recv(timeout_s)

    def close(self) -> None:
        self.inner.close()


def _corrupted(payload: ChunkPayload, rng: random.Random) -> ChunkPayload:
    """The same chunk read from a private copy of the layer with one byte flipped."""
    layer_copy = np.array(payload.src_raw[payload.layer : payload.layer + 1])
    views = chunk_views(layer_copy, 0, list(payload.src_blocks))
    view = views[rng.randrange(len(views))]
    view[rng.randrange(view.size)] ^= 0xFF
    return replace(payload, layer=0, src_raw=layer_copy)


def _misread(payload: ChunkPayload, rng: random.Random) -> ChunkPayload:
    """For a pull link, whose bytes never travel: the chunk names one wrong source block (a stale
    or misdirected read of the shared pool)."""
    blocks = list(payload.src_blocks)
    i = rng.randrange(len(blocks))
    blocks[i] = (blocks[i] + 1) % payload.src_raw.shape[2]
    return replace(payload, src_blocks=tuple(blocks))
