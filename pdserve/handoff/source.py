"""The source side of one transfer: producer gate, byte credits, send, acknowledgements, release.

Contract (one `SourceTransfer` per transfer id, on the prefill worker):
  * `LayerGate` (gate.py) is the producer gate: the engine reports per layer how many prompt
    tokens have final K/V; `begin_send` refuses a chunk whose tokens the gate does not cover, or
    whose source blocks are not known yet (PRODUCER_NOT_READY). Source blocks may arrive as
    chunked prefill allocates them (`set_src_blocks`).
  * `begin_send(chunk)` acquires byte credit (CREDIT_OVERRUN past the window), checksums the
    source bytes while they are hot and returns the `ChunkFrame` (its `offset` is the credit's
    range in the window; a resend reuses it); `mark_sent` follows the transport's send.
  * `on_ack` applies the destination's answers: a visible chunk walks SENT -> RECEIVED ->
    DEVICE_VISIBLE and only then returns its credit; a refused one is queued for resend.
  * `seal()` once every chunk is sent; `on_publish_ack` records publication.
  * `release_source()` is allowed only after publication was acknowledged and the recovery
    policy agrees; `abort(reason)` cancels open chunks and reclaims their credits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pdserve.handoff.credits import ByteCredits
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import AbortFrame, ChunkAck, ChunkFrame, PublishAck, SealFrame
from pdserve.handoff.gate import LayerGate
from pdserve.handoff.kvbytes import chunk_checksum
from pdserve.handoff.manifest import ChunkSpec, HandoffManifest
from pdserve.handoff.states import ChunkState, ChunkTable, TxnState, check_txn_move, txn_path
from pdserve.handoff.trace import TraceSink


@dataclass(frozen=True)
class ReleasePolicy:
    """When the source may drop its copy after publication (e.g. keep it while decode may fail)."""

    keep_until_decode_started: bool = False


@dataclass
class SendLog:
    send_s: dict[str, float] = field(default_factory=dict)
    num_resends: int = 0


class SourceTransfer:
    def __init__(self, manifest: HandoffManifest, pool_raw: np.ndarray, src_blocks: list[int], credits: ByteCredits,
                 gate: LayerGate, trace: TraceSink, worker: str = "prefill", max_resends: int = 8):
        self.manifest, self.raw = manifest, pool_raw
        self.src_blocks: list[int] = []
        self.set_src_blocks(src_blocks)
        self.credits, self.gate, self.trace, self.worker = credits, gate, trace, worker
        self.table = ChunkTable([c.chunk_id for c in manifest.chunks])
        self.state = TxnState.RESERVED  # a manifest exists only once the destination reserved
        self.checksums: dict[str, int] = {}
        self.resend_queue: list[str] = []
        self.max_resends = max_resends
        self.released = False
        self.terminal_reason: RejectReason | None = None
        self.log = SendLog()
        self._specs = {c.chunk_id: c for c in manifest.chunks}

    # -- helpers -------------------------------------------------------------------------------
    def _emit(self, event: str, **fields) -> None:
        f = self.manifest.fence
        self.trace.emit(event, f.request_id, self.manifest.transfer_id, f.generation, f.attempt, worker=self.worker, **fields)

    def _key(self, chunk_id: str) -> str:
        return f"{self.manifest.transfer_id}/{chunk_id}"

    def set_src_blocks(self, src_blocks: list[int]) -> None:
        """The source blocks of the transferred prompt blocks known so far (a growing prefix while
        chunked prefill allocates them; the whole list at the latest when the gate opens fully)."""
        if len(src_blocks) > self.manifest.num_transfer_blocks:
            raise HandoffError(RejectReason.INCOMPLETE_COVERAGE,
                               f"{len(src_blocks)} source blocks for {self.manifest.num_transfer_blocks}")
        self.src_blocks = list(src_blocks)  # one reference swap: readers see the old or the new list

    def _producible(self, spec: ChunkSpec) -> bool:
        return (self.gate.covers(spec.layer, spec.token_start + spec.token_count)
                and len(self.src_blocks) >= spec.first + spec.count)

    def chunk_src_blocks(self, spec: ChunkSpec) -> list[int]:
        return self.src_blocks[spec.first : spec.first + spec.count]

    def _walk(self, target: TxnState) -> None:
        for step in txn_path(self.state, target):
            self.state = check_txn_move(self.state, step)

    # -- sending -------------------------------------------------------------------------------
    def ready_chunks(self) -> list[ChunkSpec]:
        """Declared chunks the producer gate covers, in manifest order. A serialized schedule waits
        for the whole prompt before the first chunk."""
        if self.manifest.schedule == "serialized" and not self.gate.all_ready():
            return []
        return [self._specs[cid] for cid in self.table.ids_in(ChunkState.DECLARED) if self._producible(self._specs[cid])]

    def begin_send(self, chunk_id: str, stage: Callable[[int], int | None] | None = None) -> ChunkFrame:
        """`stage(offset)`, when given, may place the chunk at its credit offset and return the
        checksum of the source bytes computed in the same pass (None: this side hashes them)."""
        spec = self._specs.get(chunk_id)
        if spec is None:
            raise HandoffError(RejectReason.UNKNOWN_CHUNK, chunk_id)
        if self.state not in (TxnState.RESERVED, TxnState.TRANSFERRING):
            check_txn_move(self.state, TxnState.TRANSFERRING)
        if not self._producible(spec):
            raise HandoffError(RejectReason.PRODUCER_NOT_READY,
                               f"layer {spec.layer} tokens {spec.token_start}+{spec.token_count} not produced")
        offset = self.credits.acquire(self._key(chunk_id), spec.nbytes)
        self.table.move(chunk_id, ChunkState.CREDIT_ACQUIRED)
        if self.state is TxnState.RESERVED:
            self._walk(TxnState.TRANSFERRING)
        checksum = stage(offset) if stage is not None else None
        if checksum is None:
            checksum = chunk_checksum(self.raw, spec.layer, self.chunk_src_blocks(spec))
        self.checksums[chunk_id] = checksum
        return ChunkFrame(self.manifest.transfer_id, self.manifest.fence, chunk_id, spec.layer, spec.nbytes, checksum,
                          offset=offset)

    def mark_sent(self, frame: ChunkFrame, sent_s: float | None = None) -> None:
        """After the transport's send; `sent_s` (the trace clock) is when that send started, which
        a fast receiver may already have answered."""
        if frame.resend == 0:
            self.table.move(frame.chunk_id, ChunkState.SENT)
        sent_s = self.trace.clock() if sent_s is None else sent_s
        self.log.send_s[frame.chunk_id] = sent_s
        spec = self._specs[frame.chunk_id]
        self._emit("chunk_send", ts=sent_s, layer=frame.layer, chunk=frame.chunk_id, bytes=frame.nbytes,
                   tokens=spec.token_start + spec.token_count)

    def resend_frame(self, chunk_id: str, resend: int) -> ChunkFrame:
        """The same chunk again under the same transfer id (same bytes, same checksum)."""
        if self.table.state(chunk_id) is not ChunkState.SENT:
            raise HandoffError(RejectReason.ILLEGAL_TRANSITION, f"resend of {chunk_id} at {self.table.state(chunk_id).name}")
        self.log.num_resends += 1
        if self.log.num_resends > self.max_resends * len(self._specs):
            raise HandoffError(RejectReason.RETRIES_EXHAUSTED, chunk_id)
        spec = self._specs[chunk_id]
        self._emit("retry", layer=spec.layer, chunk=chunk_id, bytes=spec.nbytes)
        return ChunkFrame(self.manifest.transfer_id, self.manifest.fence, chunk_id, spec.layer, spec.nbytes,
                          self.checksums[chunk_id], resend, self.credits.offset_of(self._key(chunk_id)))

    def unacknowledged(self) -> list[str]:
        return self.table.ids_in(ChunkState.SENT)

    def all_sent(self) -> bool:
        return not self.table.ids_in(ChunkState.DECLARED, ChunkState.CREDIT_ACQUIRED)

    def seal(self) -> SealFrame:
        if not self.all_sent():
            raise HandoffError(RejectReason.MISSING_CHUNK, "seal before every chunk was sent")
        return SealFrame(self.manifest.transfer_id, self.manifest.fence, dict(self.checksums))

    # -- answers from the destination ----------------------------------------------------------
    def _check_answer(self, transfer_id: str, generation: int) -> None:
        if transfer_id != self.manifest.transfer_id:
            raise HandoffError(RejectReason.WRONG_TRANSFER, transfer_id)
        if generation != self.manifest.fence.generation:
            raise HandoffError(RejectReason.WRONG_GENERATION, str(generation))

    def on_ack(self, ack: ChunkAck) -> None:
        self._check_answer(ack.transfer_id, ack.generation)
        if self.state is TxnState.ABORTED:
            raise HandoffError(RejectReason.TXN_ABORTED, "ack after abort")
        if not ack.visible:
            if self.table.state(ack.chunk_id) is ChunkState.SENT and ack.chunk_id not in self.resend_queue:
                self.resend_queue.append(ack.chunk_id)
            return
        if self.table.state(ack.chunk_id) is ChunkState.DEVICE_VISIBLE:
            return  # duplicate acknowledgement
        self._mark_visible(ack.chunk_id)

    def _mark_visible(self, chunk_id: str) -> None:
        self.table.advance_to(chunk_id, ChunkState.DEVICE_VISIBLE)
        self.credits.release(self._key(chunk_id), ChunkState.DEVICE_VISIBLE)
        if chunk_id in self.resend_queue:
            self.resend_queue.remove(chunk_id)

    def on_publish_ack(self, ack: PublishAck) -> None:
        self._check_answer(ack.transfer_id, ack.generation)
        if not ack.published:
            if self.state is not TxnState.ABORTED:
                self.abort(_reason(ack.reason))
            return
        if self.state is TxnState.PUBLISHED:
            return
        if not self.all_sent():
            raise HandoffError(RejectReason.NOT_VISIBLE, "publication acknowledged for chunks never sent")
        for chunk_id in self.unacknowledged():  # publication attests visibility of every chunk
            self._mark_visible(chunk_id)
        self._walk(TxnState.PUBLISHED)
        self._emit("ack")

    def release_source(self, policy: ReleasePolicy = ReleasePolicy(), decode_started: bool = False) -> list[int]:
        """Source blocks the prefill worker may now free; refused before publication is acknowledged."""
        if self.state is not TxnState.PUBLISHED:
            raise HandoffError(RejectReason.RELEASE_BEFORE_PUBLISH, self.state.name)
        if policy.keep_until_decode_started and not decode_started:
            raise HandoffError(RejectReason.RELEASE_NOT_ALLOWED, "recovery policy keeps the source copy")
        self.released = True
        return list(self.src_blocks)

    def abort(self, reason: RejectReason) -> AbortFrame:
        """Cancel open chunks and reclaim their credits; raises ALREADY_PUBLISHED after publication."""
        self.state = check_txn_move(self.state, TxnState.ABORTED)
        for chunk_id in self.table.cancel_open():
            if self.credits.holds(self._key(chunk_id)):
                self.credits.reclaim(self._key(chunk_id))
        self.resend_queue.clear()
        self.terminal_reason = reason
        self._emit("abort", reason=reason.value)
        return AbortFrame(self.manifest.transfer_id, self.manifest.fence.generation, reason.value)


def _reason(text: str | None) -> RejectReason:
    try:
        return RejectReason(text)
    except ValueError:
        return RejectReason.CANCELLED
