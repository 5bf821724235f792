"""A decode worker's handoff endpoint: frames in, replies out, one directory of published caches.

Contract: `DecodeEndpoint` is synchronous and transport-agnostic. The worker calls `reserve`
when the router assigns a transfer, feeds every received frame to `handle` (after the transport
has placed a chunk's payload where `grant_landing` said, and ended that grant; `GrantedLanding`
does both for a link) and sends back the frames `handle`
returns. Refusals never raise out of `handle`: they are traced as `reject` and answered. What
happens on a refusal depends on its kind:
  * a fenced chunk or seal frame (stale attempt, generation or epoch) is dropped;
  * a manifest that does not match the reservation, model identity or ABI aborts;
  * a bad checksum is answered with a negative `ChunkAck` so the source may resend;
  * corruption (same chunk, other bytes), a failed validation or a stale publication aborts.
A finished transaction stays as a tombstone (late frames on its link are answered idempotently)
until its owner lets it go: `release` drops the record once it is terminal, quiescent, carried by
no link (`claim`) and held by no published handle in the directory, so a worker's table holds its
live transfers, not its history.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from pdserve.engine.kv.kv_abi import CacheIdentity
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.destination import DestinationTransfer, ReserveRequest
from pdserve.handoff.directory import DecodeDirectory, PublishedHandle
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import AbortFrame, ChunkAck, ChunkFrame, Frame, ManifestFrame, PublishAck, SealFrame
from pdserve.handoff.kvbytes import pool_bytes
from pdserve.handoff.reservations import DestinationBlocks, Reservation
from pdserve.handoff.states import TxnState
from pdserve.handoff.trace import TraceSink

_RETRYABLE = {RejectReason.BAD_CHECKSUM, RejectReason.BAD_SIZE, RejectReason.MANIFEST_MISSING}
_FENCED = {RejectReason.WRONG_TENANT, RejectReason.WRONG_REQUEST, RejectReason.WRONG_GENERATION,
           RejectReason.WRONG_ATTEMPT, RejectReason.WRONG_SOURCE_EPOCH, RejectReason.WRONG_DESTINATION_EPOCH,
           RejectReason.WRONG_RESERVATION, RejectReason.WRONG_TRANSFER, RejectReason.TXN_ABORTED}


def _transfer_id_of(frame: Frame) -> str:
    return frame.manifest.transfer_id if isinstance(frame, ManifestFrame) else frame.transfer_id


def _reason_of(text: str | None) -> RejectReason:
    try:
        return RejectReason(text)
    except ValueError:
        return RejectReason.CANCELLED


def _no_device_sync(layer: int, blocks: list[int]) -> None:
    """CPU pools: bytes written by the transport are visible to decode once the write returns."""


class DecodeEndpoint:
    def __init__(self, worker: str, epoch: int, pool: KvPool, blocks: DestinationBlocks, identity: CacheIdentity,
                 directory: DecodeDirectory | None = None, trace: TraceSink | None = None,
                 make_visible: Callable[[int, list[int]], None] = _no_device_sync, max_bad_chunks: int = 8):
        self.worker, self.epoch = worker, epoch
        self.pool, self.raw = pool, pool_bytes(pool)
        self.blocks, self.identity = blocks, identity
        self.directory = directory or DecodeDirectory()
        self.trace = trace or TraceSink()
        self.make_visible = make_visible
        self.max_bad_chunks = max_bad_chunks
        self.transfers: dict[str, DestinationTransfer] = {}
        self._bad_chunks: dict[str, int] = {}
        self._links: set[str] = set()  # transfers a receiving link carries now (`claim`)

    # -- reservation ---------------------------------------------------------------------------
    def reserve(self, request: ReserveRequest) -> Reservation:
        if request.transfer_id in self.transfers:
            raise HandoffError(RejectReason.WRONG_TRANSFER, f"{request.transfer_id} already reserved")
        txn = DestinationTransfer(request, self.worker, self.epoch, self.trace)
        reservation = txn.reserve(self.blocks)
        self.transfers[request.transfer_id] = txn
        return reservation

    # -- links and records ----------------------------------------------------------------------
    def claim(self, transfer_id: str) -> bool:
        """Take `transfer_id` for one receiving link (the caller holds the worker lock): True only
        for a reserved, unfinished transfer that no other link carries. A finished or released
        transfer cannot be claimed, so a peer naming it never reaches a transaction."""
        txn = self.transfers.get(transfer_id)
        if txn is None or txn.state >= TxnState.PUBLISHED or transfer_id in self._links:
            return False
        self._links.add(transfer_id)
        return True

    def carried(self, transfer_id: str) -> bool:
        """A receiving link carries `transfer_id` now (`claim`)."""
        return transfer_id in self._links

    def unclaim(self, transfer_id: str) -> None:
        self._links.discard(transfer_id)

    def release(self, transfer_id: str) -> bool:
        """The owner is done reading this transfer's record: drop it now if it is finished (terminal,
        no write in flight, no link on it, no published handle naming it). False while any of that
        holds: the owner releases again when the link's end is reported, and `retire` drops a
        published one whose handle it closes."""
        txn = self.transfers.get(transfer_id)
        if txn is None:
            return True
        if txn.state not in (TxnState.PUBLISHED, TxnState.ABORTED) or not txn.quiescent or transfer_id in self._links:
            return False
        handle = self.directory.lookup(txn.request.request_id)
        if handle is not None and handle.transfer_id == transfer_id:
            return False
        del self.transfers[transfer_id]
        self._bad_chunks.pop(transfer_id, None)
        return True

    # -- frames --------------------------------------------------------------------------------
    def landing_blocks(self, frame: ChunkFrame) -> list[int] | None:
        """Where the frame's payload may be written (a query: nothing is granted)."""
        txn = self.transfers.get(frame.transfer_id)
        return None if txn is None else txn.landing_blocks(frame)

    def grant_landing(self, frame: ChunkFrame) -> list[int] | None:
        """`landing_blocks` as a write grant the transport must end with `end_landing` when its
        write is over: until then an abort keeps the blocks (see destination.py)."""
        txn = self.transfers.get(frame.transfer_id)
        return None if txn is None else txn.grant_write(frame)

    def end_landing(self, transfer_id: str) -> None:
        self.transfers[transfer_id].end_write()

    def handle(self, frame: Frame, landed_checksum: int | None = None) -> list[Frame]:
        """`landed_checksum`: the receiving link's hash of the bytes it just wrote into this chunk's
        landing blocks (same pass as its copy); None makes the endpoint hash the blocks itself."""
        txn = self.transfers.get(_transfer_id_of(frame))
        if txn is None:
            self._reject_unknown(frame)
            return []
        try:
            return self._dispatch(txn, frame, landed_checksum)
        except HandoffError as err:
            return self._on_refusal(txn, frame, err)

    def _dispatch(self, txn: DestinationTransfer, frame: Frame, landed_checksum: int | None = None) -> list[Frame]:
        if isinstance(frame, ManifestFrame):
            txn.open(frame.manifest, self.identity, self.pool.abi)
            return []
        if isinstance(frame, ChunkFrame):
            return self._on_chunk(txn, frame, landed_checksum)
        if isinstance(frame, SealFrame):
            txn.accept_seal(frame)
            return self._try_publish(txn)
        if isinstance(frame, AbortFrame):
            self.abort(txn.transfer_id, _reason_of(frame.reason))
            return []
        raise HandoffError(RejectReason.ILLEGAL_TRANSITION, f"destination got {type(frame).__name__}")

    def _on_chunk(self, txn: DestinationTransfer, frame: ChunkFrame, landed_checksum: int | None) -> list[Frame]:
        if txn.state is TxnState.PUBLISHED:
            return [self._chunk_ack(txn, frame.chunk_id, True)] if txn.accepted.get(frame.chunk_id) == frame.checksum \
                else self._refuse_published_chunk(txn, frame)
        txn.land(frame, self.raw, self.make_visible, landed_checksum)
        return [self._chunk_ack(txn, frame.chunk_id, True)] + self._try_publish(txn)

    def _refuse_published_chunk(self, txn, frame: ChunkFrame) -> list[Frame]:
        self._emit_reject(txn, RejectReason.ALREADY_PUBLISHED, frame.chunk_id)
        return [self._chunk_ack(txn, frame.chunk_id, False, RejectReason.ALREADY_PUBLISHED)]

    def _try_publish(self, txn: DestinationTransfer) -> list[Frame]:
        if txn.state is TxnState.PUBLISHED:
            return [self._publish_ack(txn, True)]
        if not txn.ready_to_validate():
            return []
        txn.validate()
        result = txn.publish(self.directory)
        if result.displaced is not None:
            self._free_displaced(result.displaced)
        return [self._publish_ack(txn, True)]

    def _on_refusal(self, txn: DestinationTransfer, frame: Frame, err: HandoffError) -> list[Frame]:
        chunk = getattr(frame, "chunk_id", None)
        self._emit_reject(txn, err.reason, chunk)
        if (err.reason in _FENCED and not isinstance(frame, ManifestFrame)) or \
                (err.reason is RejectReason.MANIFEST_MISSING and isinstance(frame, SealFrame)):
            return []  # a late or misaddressed frame; the transaction itself is unaffected
        if err.reason in _RETRYABLE and isinstance(frame, ChunkFrame) and not self._too_many_bad(txn):
            return [self._chunk_ack(txn, frame.chunk_id, False, err.reason)]
        if txn.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
            txn.abort(err.reason, self.blocks)
        return [self._publish_ack(txn, False, err.reason)]

    def _too_many_bad(self, txn: DestinationTransfer) -> bool:
        self._bad_chunks[txn.transfer_id] = self._bad_chunks.get(txn.transfer_id, 0) + 1
        return self._bad_chunks[txn.transfer_id] > self.max_bad_chunks

    def refuse(self, transfer_id: str, reason: RejectReason) -> PublishAck:
        """A refusal from outside the frame protocol (the link's capability check, guard.py): traced,
        the unpublished transfer aborted (blocks back once no write is in flight), the source told."""
        txn = self.transfers[transfer_id]
        self._emit_reject(txn, reason, None)
        if txn.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
            txn.abort(reason, self.blocks)
        return self._publish_ack(txn, False, reason)

    def turn_away(self, transfer_id: str, reason: RejectReason) -> PublishAck:
        """A link's peer failed authentication before admission: traced and answered with its
        refusal, the transaction left as it was (its real source may still connect)."""
        txn = self.transfers[transfer_id]
        self._emit_reject(txn, reason, None)
        return self._publish_ack(txn, False, reason)

    # -- ownership -----------------------------------------------------------------------------
    def abort(self, transfer_id: str, reason: RejectReason) -> None:
        """Abort an unpublished transfer (raises ALREADY_PUBLISHED after publication)."""
        txn = self.transfers[transfer_id]
        if txn.state is not TxnState.ABORTED:
            txn.abort(reason, self.blocks)

    def fence_source(self, source_worker: str, new_epoch: int) -> list[str]:
        """A source worker restarted: abort every unpublished transfer from its older epochs."""
        stale = [t for t in self.transfers.values() if t.request.source_worker == source_worker
                 and t.request.source_epoch < new_epoch and t.state < TxnState.PUBLISHED]
        for txn in stale:
            txn.abort(RejectReason.WRONG_SOURCE_EPOCH, self.blocks)
        return [t.transfer_id for t in stale]

    def supersede(self, request_id: str, generation: int) -> list[str]:
        """A reroute to `generation`: fence the directory and abort older unpublished transfers."""
        self.directory.fence(request_id, generation)
        old = [t for t in self.transfers.values() if t.request.request_id == request_id
               and t.request.generation < generation and t.state < TxnState.PUBLISHED]
        for txn in old:
            txn.abort(RejectReason.SUPERSEDED, self.blocks)
        return [t.transfer_id for t in old]

    def admit(self, request_id: str) -> PublishedHandle:
        handle = self.directory.admit(request_id)
        txn = self.transfers.get(handle.transfer_id)
        attempt = txn.request.attempt if txn is not None else 0  # the published transfer's own attempt
        self.trace.emit("decode_ready", request_id, handle.transfer_id, handle.generation, attempt, worker=self.worker)
        return handle

    def retire(self, request_id: str) -> None:
        """Decode finished with the request: drop its directory entry and free its blocks."""
        handle = self.directory.retire(request_id)
        self.blocks.free(handle.reservation_id)
        self.release(handle.transfer_id)

    def _free_displaced(self, handle: PublishedHandle) -> None:
        if self.blocks.is_reserved(handle.reservation_id):
            self.blocks.free(handle.reservation_id)
        self.release(handle.transfer_id)  # no handle names it any more (its owner read it at its link's end)

    # -- replies and trace ---------------------------------------------------------------------
    def _chunk_ack(self, txn, chunk_id: str, visible: bool, reason: RejectReason | None = None) -> ChunkAck:
        return ChunkAck(txn.transfer_id, txn.request.generation, chunk_id, visible, None if reason is None else reason.value)

    def _publish_ack(self, txn, published: bool, reason: RejectReason | None = None) -> PublishAck:
        return PublishAck(txn.transfer_id, txn.request.generation, txn.request.request_id, published,
                          None if reason is None else reason.value)

    def _emit_reject(self, txn, reason: RejectReason, chunk: str | None) -> None:
        r = txn.request
        self.trace.emit("reject", r.request_id, r.transfer_id, r.generation, r.attempt, chunk=chunk,
                        reason=reason.value, worker=self.worker)

    def _reject_unknown(self, frame: Frame) -> None:
        self.trace.emit("reject", "?", _transfer_id_of(frame), getattr(frame, "generation", -1), -1, reason=RejectReason.WRONG_TRANSFER.value,
                        worker=self.worker)

    def assert_no_leaks(self) -> None:
        """Every transfer is terminal; blocks are held only by published, unretired handles."""
        open_ = [t.transfer_id for t in self.transfers.values() if t.state not in (TxnState.PUBLISHED, TxnState.ABORTED)]
        assert not open_, f"unfinished transfers: {open_}"
        busy = [t.transfer_id for t in self.transfers.values() if not t.quiescent]
        assert not busy, f"writes still in flight: {busy}"
        published = {h.reservation_id for h in (self.directory.lookup(r) for r in self.directory.owners()) if h}
        for txn in self.transfers.values():
            rid = txn.reservation.reservation_id if txn.reservation else None
            if rid is not None and rid not in published:
                assert not self.blocks.is_reserved(rid), f"{txn.transfer_id} ({txn.state.name}) still holds {rid}"


class GrantedLanding:
    """A receiving link's landing callback for one connection: asks the endpoint where a payload
    goes (under `lock`, the worker's) and ends every grant once the link's receive is over,
    whether the bytes were written or the receive failed (quiescence, see destination.py)."""

    def __init__(self, endpoint: DecodeEndpoint, lock=None):
        self.endpoint = endpoint
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.granted: list[str] = []

    def __call__(self, frame: ChunkFrame) -> list[int] | None:
        with self.lock:
            blocks = self.endpoint.grant_landing(frame)
        if blocks is not None:
            self.granted.append(frame.transfer_id)
        return blocks

    def recv(self, link, timeout_s: float) -> Frame | None:
        """`link.recv` with this callback; grants end before the frame is returned."""
        try:
            return link.recv(timeout_s, self)
        finally:
            with self.lock:
                while self.granted:
                    self.endpoint.end_landing(self.granted.pop())
