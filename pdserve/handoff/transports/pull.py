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
Several segments (a prefix fetch's holder: device pool, then host tier; handoff/segments.py): the
hello names the extra ones too, and chunk frames carry addresses in their joint space. A link
whose admitted capability binds source blocks (`bind(claims)`: `src_segments`, `src_slots`) maps
only segments of those names, in that order, and copies only the bound (segment, slot) pairs
(each still granted): a reader never touches another slot, hence another tenant's K/V.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import msgspec
import numpy as np

from pdserve.handoff.trust.capability import Claims
from pdserve.handoff.frames import ChunkFrame, Frame, ManifestFrame, SourceBlockGrant, SourcePoolHello
from pdserve.handoff.kvbytes import copy_and_checksum
from pdserve.handoff.segments import SourceSegments
from pdserve.handoff.transports.base import ChunkPayload, LinkClosed, SenderLink
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.handoff.transports.segment import SegmentReceiverLink
from pdserve.shm import AttachedSegment, attach


class ShmPullSenderLink(SenderLink):
    """Announces the source pool with the first chunk and grants each transfer's blocks as its
    chunks need them; a chunk frame names the blocks to copy from."""

    peer_reads_source = True  # the source keeps its blocks until the destination hung up

    def __init__(self, channel: SocketChannel, pool_shm_name: str, num_blocks: int,
                 extra: tuple[tuple[str, int], ...] = ()):
        super().__init__()
        self.channel = channel
        self._hello: SourcePoolHello | None = SourcePoolHello(pool_shm_name, num_blocks, extra)
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
        self.src_raw: SourceSegments | None = None  # read-only uint8 views of the source's segments
        self.transfer: str | None = None  # the transfer the grant belongs to
        self.granted: frozenset[int] = frozenset()
        self.bound: Claims | None = None  # a capability that names the source blocks (None: grants only)
        self.allowed: frozenset[int] | None = None  # the bound blocks' addresses, once mapped
        self._extra: list[AttachedSegment | shared_memory.SharedMemory] = []

    def bind(self, claims: Claims) -> None:
        """The admitted capability: when it names source blocks, only those may be read."""
        if claims.src_slots:
            self.bound = claims

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
        segments = ((hello.shm_name, hello.num_blocks),) + tuple(hello.extra)
        if self.bound is not None and tuple(n for n, _ in segments[: len(self.bound.src_segments)]) \
                != tuple(self.bound.src_segments):
            raise LinkClosed("source segments are not the capability's")
        views = [self._map(name, num_blocks, first=i == 0) for i, (name, num_blocks) in enumerate(segments)]
        self.src_raw = SourceSegments(views, [name for name, _ in segments])
        if self.bound is not None:
            self.allowed = frozenset(self.src_raw.address(seg, slot) for seg, slot in self.bound.src_slots)

    def _map(self, name: str, num_blocks: int, first: bool) -> np.ndarray:
        """A read-only uint8 view [L, 2, num_blocks, B, H, D * dtype_bytes] of one source segment."""
        shape = (self.dst_raw.shape[0], 2, num_blocks) + self.dst_raw.shape[3:]
        nbytes = int(np.prod(shape))
        try:
            shm = attach(name)
        except (FileNotFoundError, ValueError) as exc:
            raise LinkClosed(f"source pool {name!r}: {exc}") from exc
        if first:
            self._shm = shm
        else:
            self._extra.append(shm)
        if shm.size < nbytes:
            raise LinkClosed(f"source pool {name!r} holds {shm.size} B, {nbytes} B announced")
        view = np.ndarray(shape, dtype=np.uint8, buffer=shm.buf)
        view.flags.writeable = False
        return view

    def _readable(self, frame: ChunkFrame) -> bool:
        if not self.granted.issuperset(frame.src_blocks):
            return False
        return self.bound is None or (self.allowed is not None and self.allowed.issuperset(frame.src_blocks))

    def _land(self, frame: ChunkFrame, blocks: list[int] | None) -> int | None:
        src = self.src_raw
        if blocks is None or src is None or not _well_formed(frame, blocks, src) \
                or frame.transfer_id != self.transfer or not self._readable(frame):
            return None
        return copy_and_checksum(src, list(frame.src_blocks), self.dst_raw, blocks, frame.layer)

    def _drop_views(self) -> None:
        self.src_raw = None
        for shm in self._extra:
            shm.close()
        self._extra = []


def _well_formed(frame: ChunkFrame, blocks: list[int], src: SourceSegments) -> bool:
    """The frame names one source block per landing block, all inside the mapped segments."""
    return (len(frame.src_blocks) == len(blocks) and 0 <= frame.layer < src.shape[0]
            and all(src.valid(b) for b in frame.src_blocks))
