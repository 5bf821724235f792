"""Pull transport: on one host, the destination copies chunks straight out of the source's pool.

Contract: used when both workers share memory and the source's K/V pool lives in a POSIX
shared-memory segment. The sender opens with `SourcePoolHello` (its pool segment and size); the
receiver maps that segment and never writes it. A `ChunkFrame` carries the chunk's source blocks;
when `landing(frame)` admits the chunk, the receiver copies those blocks of the given layer into
its landing blocks and hashes the bytes now in its own pool in the same pass (`landed_checksum`).
The source computed the chunk's checksum from its blocks when it issued the chunk, so a source
block reused or changed before the copy fails that checksum and the chunk is refused and resent;
as with staging, only the destination writes its pool and only into chunks the protocol has not
accepted. One copy instead of staging's two: the source keeps its prompt blocks until the
publication is acknowledged anyway, so they are the staging area.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import msgspec
import numpy as np

from pdserve.handoff.frames import ChunkFrame, Frame, SourcePoolHello
from pdserve.handoff.kvbytes import copy_and_checksum
from pdserve.handoff.transports.base import ChunkPayload, LinkClosed, SenderLink
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.handoff.transports.segment import SegmentReceiverLink, forget_attached


class ShmPullSenderLink(SenderLink):
    """Announces the source pool once; a chunk frame names the blocks to copy from."""

    def __init__(self, channel: SocketChannel, pool_shm_name: str, num_blocks: int):
        super().__init__()
        self.channel = channel
        self.send(SourcePoolHello(pool_shm_name, num_blocks))

    def send(self, frame: Frame) -> None:
        header = self.channel.send_frame(frame)
        self.traffic.record(header_bytes=header, num_frames=1)

    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None:
        self.traffic.record(payload_bytes=frame.nbytes, retry_bytes=frame.nbytes if frame.resend else 0)
        self.send(msgspec.structs.replace(frame, src_blocks=tuple(payload.src_blocks)))

    def recv(self, timeout_s: float) -> Frame | None:
        return self.channel.recv_frame(timeout_s)

    def close(self) -> None:
        self.channel.close()


class ShmPullReceiverLink(SegmentReceiverLink):
    """The destination end: maps the source pool and copies admitted chunks into its own."""

    HELLO = SourcePoolHello

    def __init__(self, channel: SocketChannel, dst_raw: np.ndarray):
        super().__init__(channel, dst_raw)
        self.src_raw: np.ndarray | None = None  # read-only uint8 view, shaped like dst_raw but N source blocks

    def _on_hello(self, hello: SourcePoolHello) -> None:
        if self._shm is not None:
            raise LinkClosed("source pool announced twice")
        shape = (self.dst_raw.shape[0], 2, hello.num_blocks) + self.dst_raw.shape[3:]
        nbytes = int(np.prod(shape))
        try:
            self._shm = shared_memory.SharedMemory(name=hello.shm_name, create=False)
        except (FileNotFoundError, ValueError) as exc:
            raise LinkClosed(f"source pool {hello.shm_name!r}: {exc}") from exc
        forget_attached(self._shm)
        if self._shm.size < nbytes:
            raise LinkClosed(f"source pool {hello.shm_name!r} holds {self._shm.size} B, {nbytes} B announced")
        view = np.ndarray(shape, dtype=np.uint8, buffer=self._shm.buf)
        view.flags.writeable = False
        self.src_raw = view

    def _land(self, frame: ChunkFrame, blocks: list[int] | None) -> int | None:
        src = self.src_raw
        if blocks is None or src is None or not _well_formed(frame, blocks, src.shape):
            return None
        return copy_and_checksum(src, list(frame.src_blocks), self.dst_raw, blocks, frame.layer)

    def _drop_views(self) -> None:
        self.src_raw = None


def _well_formed(frame: ChunkFrame, blocks: list[int], src_shape: tuple[int, ...]) -> bool:
    """The frame names one source block per landing block, all inside the mapped pool."""
    return (len(frame.src_blocks) == len(blocks) and 0 <= frame.layer < src_shape[0]
            and all(0 <= b < src_shape[2] for b in frame.src_blocks))
