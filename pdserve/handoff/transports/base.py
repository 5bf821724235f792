"""The transport interface shared by all backends.

Contract:
  * `SenderLink.send_chunk(frame, payload)` makes the chunk's bytes reach the destination's
    link (a byte stream, a staging area, a queue) and then delivers `frame`; `send(frame)`
    delivers a control frame; `recv(timeout_s)` returns the destination's next answer or None.
    A sender never writes the destination pool. `stage(offset, payload)` lets a staging link
    copy and checksum a first send in one pass; `send_chunk` then skips that copy.
  * `ReceiverLink.recv(timeout_s, landing)` returns the next frame; for a `ChunkFrame` the link
    writes its payload into the blocks `landing(frame)` returns, or discards it when that is
    None. Only this call writes the destination pool, on the destination's own thread, and
    only into chunks the protocol has not accepted: once a chunk is accepted (or the transfer
    published) no late, duplicated or corrupted copy can change its bytes.
    `send(frame)` answers the source.
  * Links count physical traffic (headers, payload, resends) in `traffic`; they never interpret
    the protocol and never know model internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pdserve.handoff.frames import ChunkFrame, Frame
from pdserve.ledger.kv import PhysicalTraffic

Landing = Callable[[ChunkFrame], "list[int] | None"]


@dataclass
class TrafficCounter:
    """A link's mutable accumulator around the ledger's `PhysicalTraffic`, for its hot path."""

    snapshot: PhysicalTraffic = field(default_factory=PhysicalTraffic)

    def record(self, **deltas: int) -> None:
        self.snapshot = self.snapshot.add(**deltas)


@dataclass(frozen=True)
class ChunkPayload:
    """Where one chunk's bytes come from and where they must land."""

    layer: int
    src_raw: np.ndarray  # uint8 view of the source pool, see kvbytes.pool_bytes
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class SenderLink(ABC):
    peer_reads_source = False  # True when the destination copies out of the source's own memory (pull)

    def __init__(self) -> None:
        self.traffic = TrafficCounter()

    @abstractmethod
    def send(self, frame: Frame) -> None: ...

    @abstractmethod
    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None: ...

    def stage(self, offset: int, payload: ChunkPayload) -> int | None:
        """Optionally place `payload` at `offset` of the link's staging area ahead of `send_chunk`,
        returning the checksum of the source bytes from the same pass; None when the link has no
        staging (the protocol then hashes the source itself)."""
        return None

    @abstractmethod
    def recv(self, timeout_s: float) -> Frame | None: ...

    def close(self) -> None:
        """Release OS resources; idempotent."""


class ReceiverLink(ABC):
    def __init__(self) -> None:
        self.traffic = TrafficCounter()

    @abstractmethod
    def recv(self, timeout_s: float, landing: Landing) -> Frame | None: ...

    @abstractmethod
    def send(self, frame: Frame) -> None: ...

    def landed_checksum(self, frame: ChunkFrame) -> int | None:
        """Checksum of the bytes this link just wrote into `frame`'s landing blocks, computed in
        the same pass as its copy (the destination's own memory); None: the endpoint hashes them."""
        return None

    def close(self) -> None:
        """Release OS resources; idempotent."""


class LinkClosed(ConnectionError):
    """The peer went away mid-transfer."""
