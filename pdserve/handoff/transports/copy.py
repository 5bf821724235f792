"""Copy transports: chunk bytes wait where only the destination reads them; only it writes its pool.

Contract: used when both workers share memory. The sender never writes the destination pool.
  * `inproc_links` (tests, one process): a chunk frame travels with a reference to the source
    bytes; the receiver copies them into the blocks `landing(frame)` names, or drops them.
  * `ShmSenderLink` / `ShmReceiverLink` (same host, other process): the receiver owns a POSIX
    shared-memory *staging* area as large as the sender's credit window (offered in-band after
    the sender's `StagingHello`; with `deferred`, only once the link's capability was checked). The sender copies a chunk to the frame's credit range
    `[offset, offset + nbytes)` of staging (a first send hashes and copies it in one pass via
    `stage`), then sends the frame on a `SocketChannel`; the
    receiver, when `landing(frame)` admits the chunk, copies staging into its reserved blocks and
    hashes them there in the same pass (`landed_checksum`).
Why: the destination verifies a chunk's checksum on the bytes in its own pool after its own
copy, so a late, duplicated, torn or stale-source write can only dirty staging: it fails the
checksum of whichever chunk reads that range next (which is then resent), and can never touch a
block after the destination accepted it or after publication. The cost is a second copy.
"""

from __future__ import annotations

import secrets
from multiprocessing import shared_memory

import numpy as np

from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import ChunkFrame, Frame, PublishAck, StagingHello, StagingOffer
from pdserve.handoff.kvbytes import (checksum_and_gather, chunk_nbytes, copy_chunk, gather_chunk, pool_bytes,
                                     scatter_and_checksum)
from pdserve.handoff.transports.base import ChunkPayload, Landing, LinkClosed, ReceiverLink, SenderLink
from pdserve.handoff.transports.channels import QueueChannel, SocketChannel
from pdserve.handoff.transports.segment import SegmentReceiverLink
from pdserve.shm import AttachedSegment, attach

MAX_STAGING_BYTES = 1 << 30


class InProcSenderLink(SenderLink):
    def __init__(self, out: QueueChannel, back: QueueChannel):
        super().__init__()
        self.out, self.back = out, back

    def send(self, frame: Frame) -> None:
        self.traffic.record(num_frames=1)
        self.out.put((frame, None))

    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None:
        self.traffic.record(payload_bytes=frame.nbytes, retry_bytes=frame.nbytes if frame.resend else 0, num_frames=1)
        self.out.put((frame, payload))

    def recv(self, timeout_s: float) -> Frame | None:
        return self.back.get(timeout_s)

    def close(self) -> None:
        self.out.close()


class InProcReceiverLink(ReceiverLink):
    def __init__(self, inbox: QueueChannel, back: QueueChannel, dst_raw: np.ndarray):
        super().__init__()
        self.inbox, self.back, self.dst_raw = inbox, back, dst_raw

    def recv(self, timeout_s: float, landing: Landing) -> Frame | None:
        item = self.inbox.get(timeout_s)
        if item is None:
            return None
        frame, payload = item
        if payload is not None and (blocks := landing(frame)) is not None:
            copy_chunk(payload.src_raw, list(payload.src_blocks), self.dst_raw, blocks, payload.layer)
        return frame

    def send(self, frame: Frame) -> None:
        self.back.put(frame)

    def close(self) -> None:
        self.back.close()


def inproc_links(dst_pool: KvPool) -> tuple[InProcSenderLink, InProcReceiverLink]:
    out, back = QueueChannel(), QueueChannel()
    return InProcSenderLink(out, back), InProcReceiverLink(out, back, pool_bytes(dst_pool))


class ShmSenderLink(SenderLink):
    """Copies chunks into the receiver's staging area; frames go over `channel`."""

    def __init__(self, channel: SocketChannel, window_bytes: int, offer_timeout_s: float = 10.0):
        super().__init__()
        self.channel, self.window_bytes, self.offer_timeout_s = channel, window_bytes, offer_timeout_s
        self._shm: AttachedSegment | shared_memory.SharedMemory | None = None  # the receiver's, attached
        self.staging: np.ndarray | None = None  # uint8 [window_bytes], the receiver's segment
        self._staged: tuple[int, int, ChunkPayload] | None = None  # the `stage` call send_chunk may reuse
        self.send(StagingHello(window_bytes))

    def _take_offer(self, offer: StagingOffer) -> None:
        if offer.nbytes < self.window_bytes:
            raise LinkClosed(f"staging of {offer.nbytes} B for a window of {self.window_bytes} B")
        self._shm = attach(offer.shm_name)
        self.staging = np.ndarray((offer.nbytes,), dtype=np.uint8, buffer=self._shm.buf)

    def _wait_for_offer(self) -> None:
        frame = self.channel.recv_frame(self.offer_timeout_s)
        if isinstance(frame, PublishAck) and not frame.published:  # refused before any staging was offered
            raise HandoffError(_reason(frame.reason), "refused before staging was offered")
        if not isinstance(frame, StagingOffer):
            raise LinkClosed(f"expected a staging offer, got {type(frame).__name__}")
        self._take_offer(frame)

    def send(self, frame: Frame) -> None:
        header = self.channel.send_frame(frame)
        self.traffic.record(header_bytes=header, num_frames=1)

    def _range(self, offset: int, nbytes: int) -> np.ndarray:
        if self.staging is None:
            self._wait_for_offer()
        if offset + nbytes > self.window_bytes:
            raise LinkClosed(f"chunk range {offset}+{nbytes} outside the window")
        return self.staging[offset : offset + nbytes]

    def stage(self, offset: int, payload: ChunkPayload) -> int:
        nbytes = chunk_nbytes(payload.src_raw, len(payload.src_blocks))
        checksum = checksum_and_gather(payload.src_raw, payload.layer, list(payload.src_blocks),
                                       self._range(offset, nbytes))
        self._staged = (offset, nbytes, payload)
        return checksum

    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None:
        staged, self._staged = self._staged, None
        if staged is None or staged[2] is not payload or staged[:2] != (frame.offset, frame.nbytes):
            gather_chunk(payload.src_raw, payload.layer, list(payload.src_blocks), self._range(frame.offset, frame.nbytes))
        self.traffic.record(payload_bytes=frame.nbytes, retry_bytes=frame.nbytes if frame.resend else 0)
        self.send(frame)

    def recv(self, timeout_s: float) -> Frame | None:
        frame = self.channel.recv_frame(timeout_s)
        if isinstance(frame, StagingOffer):
            self._take_offer(frame)
            return None
        return frame

    def close(self) -> None:
        self.staging = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self.channel.close()


class ShmReceiverLink(SegmentReceiverLink):
    """The destination end: owns the staging segment and copies admitted chunks into its pool."""

    HELLO = StagingHello
    owns_segment = True

    def __init__(self, channel: SocketChannel, dst_raw: np.ndarray, max_staging_bytes: int = MAX_STAGING_BYTES,
                 deferred: bool = False):
        super().__init__(channel, dst_raw)
        self.max_staging_bytes = max_staging_bytes
        self.staging: np.ndarray | None = None
        self.deferred = deferred  # True: no staging exists or is offered until `open_staging` (a capability check)
        self._window = 0

    def _on_hello(self, hello: StagingHello) -> None:
        if self._window or not 0 < hello.window_bytes <= self.max_staging_bytes:
            raise LinkClosed(f"refused staging of {hello.window_bytes} B")
        self._window = hello.window_bytes
        if not self.deferred:
            self.open_staging()

    def open_staging(self) -> None:
        """Create the staging segment the sender asked for and offer it (once)."""
        if not self._window or self._shm is not None:
            return
        # owner-only (Python creates segments 0600) under an unguessable name: see docs/security.md
        self._shm = shared_memory.SharedMemory(name=f"pdstage-{secrets.token_hex(16)}", create=True, size=self._window)
        self.staging = np.ndarray((self._window,), dtype=np.uint8, buffer=self._shm.buf)
        self.channel.send_frame(StagingOffer(self._shm.name, self._window))

    def _land(self, frame: ChunkFrame, blocks: list[int] | None) -> int | None:
        if blocks is None or self.staging is None or frame.offset + frame.nbytes > self.staging.size:
            return None
        staged = self.staging[frame.offset : frame.offset + frame.nbytes]
        return scatter_and_checksum(staged, self.dst_raw, frame.layer, blocks)

    def _drop_views(self) -> None:
        self.staging = None


def _reason(text: str | None) -> RejectReason:
    try:
        return RejectReason(text)
    except ValueError:
        return RejectReason.TRANSPORT_FAILURE
