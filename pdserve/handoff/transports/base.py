"""The transport interface shared by all backends.

Contract:
  * `SenderLink.send_chunk(frame, payload)` makes the chunk's bytes reach the destination's
    blocks `payload.dst_blocks` (or the byte stream) and then delivers `frame`; `send(frame)`
    delivers a control frame; `recv(timeout_s)` returns the destination's next answer or None.
  * `ReceiverLink.recv(timeout_s, landing)` returns the next frame; for a `ChunkFrame` whose
    payload travels on the stream, the link writes it into the blocks `landing(frame)` returns,
    or discards it when that is None. `send(frame)` answers the source.
  * Links count physical traffic (headers, payload, resends) in `traffic`; they never interpret
    the protocol and never know model internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pdserve.handoff.frames import ChunkFrame, Frame
from pdserve.handoff.sets import TrafficCounter

Landing = Callable[[ChunkFrame], "list[int] | None"]


@dataclass(frozen=True)
class ChunkPayload:
    """Where one chunk's bytes come from and where they must land."""

    layer: int
    src_raw: np.ndarray  # uint8 view of the source pool, see kvbytes.pool_bytes
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class SenderLink(ABC):
    def __init__(self) -> None:
        self.traffic = TrafficCounter()

    @abstractmethod
    def send(self, frame: Frame) -> None: ...

    @abstractmethod
    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None: ...

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

    def close(self) -> None:
        """Release OS resources; idempotent."""


class LinkClosed(ConnectionError):
    """The peer went away mid-transfer."""
