"""Pull transport: on one host, the destination copies chunks straight out of the source's pool.

Contract: used when both workers share memory and the source's K/V pool lives in a POSIX
shared-memory segment (mode 0600, unguessable name). The sender reveals the segment only with
its first chunk (`SourcePoolHello`: segment and size), after the link's manifest, and grants the
receiver, per transfer, exactly the source blocks that transfer's chunks name
(`SourceBlockGrant`, sent before the first chunk that needs them; a manifest of another transfer
id starts an empty grant). The receiver refuses a pool announced before any manifest, maps the
segment read-only, never writes it, and copies only granted blocks. A `ChunkFrame` carries the chunk's source blocks;
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

from pdserve.handoff.frames import ChunkFrame, Frame, ManifestFrame, SourceBlockGrant, SourcePoolHello
from pdserve.handoff.kvbytes import copy_and_checksum
from pdserve.handoff.transports.base import ChunkPayload, LinkClosed, SenderLink
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.handoff.transports.segment import SegmentReceiverLink, forget_attached


class ShmPullSenderLink(SenderLink):
    """Announces the source pool with the first chunk and grants each transfer's blocks as its
    chunks need them; a chunk frame names the blocks to copy from."""

    def __init__(self, channel: SocketChannel, pool_shm_name: str, num_blocks: int):
        super().__init__()
        self.channel = channel
        self._hello: SourcePoolHello | None = SourcePoolHello(pool_shm_name, num_blocks)
        self._transfer: str | None = None
        self._granted: set[int] = set()

    def send(self, frame: Frame) -> None:
        if isinstance(frame, ManifestFrame) and frame.manifest.transfer_id != self._transfer:
            self._transfer, self._granted = frame.manifest.transfer_id, set()
        header = self.channel.send_frame(frame)
        self.traffic.record(header_bytes=header, num_frames=1)

    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None:
        if self._hello is not None:
            hello, self._hello = self._hello, None
            self.send(hello)
        fresh = tuple(b for b in payload.src_blocks if b not in self._granted)
        if fresh:
            self.send(SourceBlockGrant(frame.transfer_id, fresh))
            self._granted.update(fresh)
        self.traffic.record(payload_bytes=frame.nbytes, retry_bytes=frame.nbytes if frame.resend else 0)
        self.send(msgspec.structs.replace(frame, src_blocks=tuple(payload.src_blocks)))

    def recv(self, timeout_s: float) -> Frame | None:
        return self.channel.recv_frame(timeout_s)

    def close(self) -> None:
        self.channel.close()


class ShmPullReceiverLink(SegmentReceiverLink):
    """The destination end: maps the source pool and copies admitted chunks into its own."""

    HELLO = (SourcePoolHello, SourceBlockGrant)

    def __init__(self, channel: SocketChannel, dst_raw: np.ndarray):
        super().__init__(channel, dst_raw)
        self.src_raw: np.ndarray | None = None  # read-only uint8 view, shaped like dst_raw but N source blocks
        self.transfer: str | None = None  # the transfer the grant belongs to
        self.granted: frozenset[int] = frozenset()

    def recv(self, timeout_s: float, landing):
        frame = super().recv(timeout_s, landing)
        if isinstance(frame, ManifestFrame) and frame.manifest.transfer_id != self.transfer:
            self.transfer, self.granted = frame.manifest.transfer_id, frozenset()  # a new transfer: nothing granted
        return frame

    def _on_hello(self, hello: SourcePoolHello | SourceBlockGrant) -> None:
        if isinstance(hello, SourceBlockGrant):
            if hello.transfer_id == self.transfer:
                self.granted |= frozenset(hello.blocks)
            return
        if self.transfer is None:  # only a link whose manifest came first (and was checked) maps a pool
            raise LinkClosed("source pool announced before any manifest")
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
        if blocks is None or src is None or not _well_formed(frame, blocks, src.shape) \
                or frame.transfer_id != self.transfer or not self.granted.issuperset(frame.src_blocks):
            return None
        return copy_and_checksum(src, list(frame.src_blocks), self.dst_raw, blocks, frame.layer)

    def _drop_views(self) -> None:
        self.src_raw = None


def _well_formed(frame: ChunkFrame, blocks: list[int], src_shape: tuple[int, ...]) -> bool:
    """The frame names one source block per landing block, all inside the mapped pool."""
    return (len(frame.src_blocks) == len(blocks) and 0 <= frame.layer < src_shape[0]
            and all(0 <= b < src_shape[2] for b in frame.src_blocks))
