"""The destination side of one transfer: reserve -> land chunks -> validate -> publish, or abort.

Contract (one `DestinationTransfer` per transfer id, driven by `DecodeEndpoint`):
  * created PLANNED, then RESERVED once its blocks are reserved; `open(manifest)` checks the
    manifest against the reservation, the destination's model identity and K/V ABI;
  * `landing_blocks(frame)` says where a chunk's payload may be written (None = discard), so a
    byte-stream transport never writes a fenced, unknown or already-accepted chunk;
  * `land(frame)` runs after the payload is in the reserved blocks: it checks the fence and the
    checksum of the bytes actually in the pool, then moves the chunk RECEIVED -> DEVICE_VISIBLE;
  * `validate()` then `publish(directory)` (one CAS); `abort(reason)` is the only cleanup path
    before publication: cancel open chunks, free the unpublished reservation, record the reason.
  * Quiescence before release: a transport asks `grant_write(frame)` (`landing_blocks` counted as
    a write in flight) and ends it with `end_write()` once its bytes are in (or it gave up). An abort fences the
    transaction at once (no new grant, every later frame refused) but returns the blocks only
    when the last granted write has ended, so a late copy can never land in blocks that another
    request already owns.
After PUBLISHED the reserved blocks belong to the directory entry; after ABORTED and quiescence
they are free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pdserve.engine.kv.kv_abi import CacheIdentity
from pdserve.handoff.directory import DecodeDirectory, PublishedHandle, PublishResult
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import ChunkFrame, SealFrame
from pdserve.handoff.kvbytes import chunk_checksum
from pdserve.handoff.manifest import HandoffManifest, IdentityFence, check_fence, check_identity
from pdserve.handoff.shard_map import check_layout
from pdserve.handoff.reservations import DestinationBlocks, Reservation
from pdserve.handoff.states import ChunkState, ChunkTable, TxnState, check_txn_move
from pdserve.handoff.trace import TraceSink
from pdserve.handoff.validate import validate_landing


@dataclass(frozen=True)
class ReserveRequest:
    """What the router asks of a decode worker before a transfer starts."""

    transfer_id: str
    tenant: str
    request_id: str
    generation: int
    attempt: int
    source_worker: str
    source_epoch: int
    prompt_digest: str
    num_tokens: int
    num_transfer_blocks: int
    num_growth_blocks: int = 0
    reused_block_ids: tuple[int, ...] = ()  # destination blocks already holding the prompt prefix


@dataclass
class LandingLog:
    """Per-layer visibility times (clock of the trace sink) and the publication time."""

    layer_visible_s: dict[int, float] = field(default_factory=dict)
    publish_s: float | None = None


class DestinationTransfer:
    def __init__(self, request: ReserveRequest, worker: str, epoch: int, trace: TraceSink):
        self.request = request
        self.worker, self.epoch, self.trace = worker, epoch, trace
        self.state = TxnState.PLANNED
        self.reservation: Reservation | None = None
        self.manifest: HandoffManifest | None = None
        self.table: ChunkTable | None = None
        self.accepted: dict[str, int] = {}
        self.seal: SealFrame | None = None
        self.terminal_reason: RejectReason | None = None
        self.handle: PublishedHandle | None = None
        self.log = LandingLog()
        self.writers = 0  # write grants handed out and not yet ended
        self._release_after_writes: DestinationBlocks | None = None

    @property
    def transfer_id(self) -> str:
        return self.request.transfer_id

    def _move(self, new: TxnState) -> None:
        self.state = check_txn_move(self.state, new)

    def _emit(self, event: str, **fields) -> None:
        r = self.request
        self.trace.emit(event, r.request_id, r.transfer_id, r.generation, r.attempt, worker=self.worker, **fields)

    def reserve(self, blocks: DestinationBlocks) -> Reservation:
        r = self.request
        self.reservation = blocks.reserve(r.transfer_id, r.num_transfer_blocks, r.num_growth_blocks)
        self._move(TxnState.RESERVED)
        self._emit("reserve", bytes=None, reason=None)
        return self.reservation

    def expected_fence(self) -> IdentityFence:
        r, res = self.request, self.reservation
        assert res is not None
        return IdentityFence(r.tenant, r.request_id, r.generation, r.attempt, r.source_worker, r.source_epoch,
                             self.worker, self.epoch, res.reservation_id)

    def open(self, manifest: HandoffManifest, identity: CacheIdentity, pool_abi) -> None:
        """Accept the manifest if it names exactly this reservation, prompt, model and ABI.
        The same manifest again is a no-op; a different one for an opened transfer is a conflict."""
        if self.manifest is not None and self.state is not TxnState.ABORTED:
            if manifest != self.manifest:
                raise HandoffError(RejectReason.CHUNK_CONFLICT, "transfer reopened with another manifest")
            return
        if self.state is not TxnState.RESERVED:
            check_txn_move(self.state, TxnState.TRANSFERRING)
        if manifest.transfer_id != self.transfer_id:
            raise HandoffError(RejectReason.WRONG_TRANSFER, manifest.transfer_id)
        check_fence(self.expected_fence(), manifest.fence)
        check_identity(identity, pool_abi, manifest)
        check_layout(manifest.shards, pool_abi)  # any TP layout that tiles the logical heads (shard_map.py)
        if manifest.prompt.digest != self.request.prompt_digest or manifest.prompt.num_tokens != self.request.num_tokens:
            raise HandoffError(RejectReason.WRONG_PROMPT, manifest.prompt.digest)
        if manifest.dst_blocks != self.reservation.prompt_blocks:
            raise HandoffError(RejectReason.WRONG_RESERVATION, "manifest blocks differ from the reservation")
        self.manifest, self.table = manifest, ChunkTable([c.chunk_id for c in manifest.chunks])
        self._move(TxnState.TRANSFERRING)

    def check_frame(self, frame: ChunkFrame | SealFrame) -> None:
        """Fence a frame: right transfer, open transaction, exact identity fence."""
        if self.state is TxnState.ABORTED:
            raise HandoffError(RejectReason.TXN_ABORTED, self.transfer_id)
        if self.manifest is None:
            raise HandoffError(RejectReason.MANIFEST_MISSING, "frame before manifest")
        if frame.transfer_id != self.transfer_id:
            raise HandoffError(RejectReason.WRONG_TRANSFER, frame.transfer_id)
        check_fence(self.manifest.fence, frame.fence)

    def landing_blocks(self, frame: ChunkFrame) -> list[int] | None:
        """Destination blocks the frame's payload may be written to, or None to discard it."""
        try:
            self.check_frame(frame)
        except HandoffError:
            return None
        if self.state is not TxnState.TRANSFERRING or frame.chunk_id not in self.table:
            return None
        if self.table.state(frame.chunk_id) >= ChunkState.RECEIVED:
            return None
        spec = self.manifest.chunk(frame.chunk_id)
        return self.manifest.chunk_dst_blocks(spec) if spec.nbytes == frame.nbytes and spec.layer == frame.layer else None

    def grant_write(self, frame: ChunkFrame) -> list[int] | None:
        """`landing_blocks`, counted as a write in flight until `end_write` (None: nothing granted)."""
        blocks = self.landing_blocks(frame)
        if blocks is not None:
            self.writers += 1
        return blocks

    def end_write(self) -> None:
        """A granted write finished or was given up; the last one lets an abort release the blocks."""
        if self.writers <= 0:
            raise HandoffError(RejectReason.ILLEGAL_TRANSITION, f"{self.transfer_id}: write ended without a grant")
        self.writers -= 1
        if self.writers == 0 and self._release_after_writes is not None:
            blocks, self._release_after_writes = self._release_after_writes, None
            self._release(blocks)
            self._emit("quiesced", reason=self.terminal_reason.value if self.terminal_reason else None)

    @property
    def quiescent(self) -> bool:
        """No write into this transfer's blocks is in flight and no release is waiting for one."""
        return self.writers == 0 and self._release_after_writes is None

    def land(self, frame: ChunkFrame, pool_raw: np.ndarray, make_visible: Callable[[int, list[int]], None],
             landed_checksum: int | None = None) -> bool:
        """Verify a landed chunk; returns False for an idempotent duplicate. Raises on refusal.
        `landed_checksum` is the receiving link's hash of the bytes it wrote into the blocks."""
        self.check_frame(frame)
        if frame.chunk_id not in self.table:
            raise HandoffError(RejectReason.UNKNOWN_CHUNK, frame.chunk_id)
        spec = self.manifest.chunk(frame.chunk_id)
        if frame.chunk_id in self.accepted:
            if self.accepted[frame.chunk_id] != frame.checksum:
                raise HandoffError(RejectReason.CHUNK_CONFLICT, f"{frame.chunk_id} resent with other bytes")
            return False
        if self.state is not TxnState.TRANSFERRING:
            check_txn_move(self.state, TxnState.TRANSFERRING)
        if frame.nbytes != spec.nbytes or frame.layer != spec.layer:
            raise HandoffError(RejectReason.BAD_SIZE, f"{frame.chunk_id}: {frame.nbytes} B on layer {frame.layer}")
        blocks = self.manifest.chunk_dst_blocks(spec)
        if landed_checksum is None:
            landed_checksum = chunk_checksum(pool_raw, spec.layer, blocks)
        if landed_checksum != frame.checksum:
            raise HandoffError(RejectReason.BAD_CHECKSUM, frame.chunk_id)
        self._mark_landed(spec, frame.checksum, blocks, make_visible)
        return True

    def _mark_landed(self, spec, checksum: int, blocks: list[int], make_visible) -> None:
        self.table.advance_to(spec.chunk_id, ChunkState.RECEIVED)
        self.accepted[spec.chunk_id] = checksum
        self._emit("chunk_receive", layer=spec.layer, chunk=spec.chunk_id, bytes=spec.nbytes)
        make_visible(spec.layer, blocks)
        self.table.move(spec.chunk_id, ChunkState.DEVICE_VISIBLE)
        self.log.layer_visible_s[spec.layer] = self.trace.clock()
        self._emit("chunk_visible", layer=spec.layer, chunk=spec.chunk_id, bytes=spec.nbytes)

    def accept_seal(self, seal: SealFrame) -> None:
        self.check_frame(seal)
        if self.seal is not None and self.seal.checksums != seal.checksums:
            raise HandoffError(RejectReason.CHUNK_CONFLICT, "seal resent with other checksums")
        self.seal = seal

    def ready_to_validate(self) -> bool:
        return self.seal is not None and self.state is TxnState.TRANSFERRING and self.table.all_in(ChunkState.DEVICE_VISIBLE)

    def validate(self) -> None:
        if self.state is not TxnState.TRANSFERRING:
            check_txn_move(self.state, TxnState.VALIDATED)
        seal_fence = None if self.seal is None else self.seal.fence
        checksums = None if self.seal is None else self.seal.checksums
        validate_landing(self.manifest, seal_fence, checksums, self.accepted, self.table)
        self._move(TxnState.VALIDATED)
        self._emit("validate")

    def publish(self, directory: DecodeDirectory) -> PublishResult:
        """The one atomic ownership change; only a VALIDATED transaction may attempt it."""
        if self.state is not TxnState.VALIDATED:
            check_txn_move(self.state, TxnState.PUBLISHED)
        res, r = self.reservation, self.request
        handle = PublishedHandle(r.request_id, r.generation, r.transfer_id, res.reservation_id,
                                 r.reused_block_ids + res.prompt_blocks, res.growth_blocks, r.num_tokens)
        result = directory.publish(handle)
        self._move(TxnState.PUBLISHED)
        self.handle = result.handle
        self.log.publish_s = self.trace.clock()
        self._emit("publish")
        return result

    def abort(self, reason: RejectReason, blocks: DestinationBlocks) -> None:
        """The single pre-publication cleanup path. Raises ALREADY_PUBLISHED after publication."""
        self._move(TxnState.ABORTED)
        if self.table is not None:
            self.table.cancel_open()
        self.terminal_reason = reason
        if self.writers:  # fenced now, released when the in-flight writes end (end_write)
            self._release_after_writes = blocks
        else:
            self._release(blocks)
        self._emit("abort", reason=reason.value)

    def _release(self, blocks: DestinationBlocks) -> None:
        if self.reservation is not None and blocks.is_reserved(self.reservation.reservation_id):
            blocks.free(self.reservation.reservation_id)
