"""The shared-memory half that the staging and pull receivers have in common.

Contract: a `SegmentReceiverLink` is a destination link whose chunk bytes sit in a POSIX
shared-memory segment (the receiver's own staging area, or the source's pool) while frames travel
on a `SocketChannel`. `recv` answers the link's own handshake frame (`HELLO`, never returned to the
caller) by `_on_hello` (ignored once `handshakes_closed`: a refused link maps nothing more), then for a `ChunkFrame` asks `landing(frame)` for blocks and lets `_land`
copy the admitted chunk into this worker's pool, returning the checksum of the bytes now there
(or None: fenced, duplicate or malformed, and the pool is not touched). `close` drops the views
and the segment, and unlinks it only when this side created it.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from pdserve.handoff.frames import ChunkFrame, Frame
from pdserve.handoff.transports.base import Landing, ReceiverLink
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.shm import AttachedSegment


class SegmentReceiverLink(ReceiverLink):
    HELLO: type | tuple[type, ...]  # the link-level handshake frame(s) this receiver answers
    owns_segment = False  # True: this side created the segment and unlinks it on close

    def __init__(self, channel: SocketChannel, dst_raw: np.ndarray):
        super().__init__()
        self.channel, self.dst_raw = channel, dst_raw
        self._shm: shared_memory.SharedMemory | AttachedSegment | None = None  # created (staging) or attached
        self._landed: tuple[ChunkFrame, int] | None = None  # the last chunk this link wrote, hashed
        self.handshakes_closed = False  # after a refusal: handshake frames are read and ignored (nothing mapped)

    def _on_hello(self, hello) -> None:
        raise NotImplementedError

    def _land(self, frame: ChunkFrame, blocks: list[int] | None) -> int | None:
        raise NotImplementedError

    def _drop_views(self) -> None:
        """Forget every numpy view of the segment (it cannot close while one exists)."""

    def recv(self, timeout_s: float, landing: Landing) -> Frame | None:
        self._landed = None
        frame = self.channel.recv_frame(timeout_s)
        while isinstance(frame, self.HELLO):  # the link's own handshake; callers never see it
            if not self.handshakes_closed:
                self._on_hello(frame)
            frame = self.channel.recv_frame(timeout_s)
        if isinstance(frame, ChunkFrame):
            checksum = self._land(frame, landing(frame))
            if checksum is not None:
                self._landed = (frame, checksum)
                self.traffic.record(payload_bytes=frame.nbytes, num_frames=1)
        return frame

    def landed_checksum(self, frame: ChunkFrame) -> int | None:
        landed, self._landed = self._landed, None
        return landed[1] if landed is not None and landed[0] is frame else None

    def send(self, frame: Frame) -> None:
        self.channel.send_frame(frame)

    def close(self) -> None:
        self._drop_views()
        if self._shm is not None:
            self._shm.close()
            if self.owns_segment:
                try:
                    self._shm.unlink()
                except FileNotFoundError:  # already gone (a peer's cleanup after a crash)
                    pass
            self._shm = None
        self.channel.close()
