"""Drive a transfer end to end over any link: the loops shared by every transport.

Contract:
  * `drive_source` runs on the prefill worker: manifest -> chunks as layers pass the producer
    gate and credits allow -> seal -> wait for publication. Unanswered chunks are resent under
    the same transfer id after `ack_timeout_s`. It returns the source transfer in PUBLISHED or
    ABORTED state; on a dead link it aborts (credits reclaimed) rather than raising. `cancelled()`
    (checked every loop and before every chunk sent) aborts it on the owner's word: the
    destination is told with an AbortFrame.
  * `await_peer_close` is the source's quiescence step after an abort: the destination may be
    copying out of the source's blocks (pull) until it hangs up, so the caller releases them
    only once it returned True (never because a wait ran out).
  * `serve_destination` runs on the decode worker: frames in, `DecodeEndpoint.handle`, answers
    out, until the transfer is terminal. A dead or silent link aborts the unpublished transfer.
    With a `LinkGuard` (guard.py) nothing reaches the endpoint or lands before the link's
    manifest passed the capability check.
Neither loop knows which transport it drives.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.handoff.endpoint import DecodeEndpoint, GrantedLanding
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import ChunkAck, ChunkFrame, ManifestFrame, PublishAck
from pdserve.handoff.trust.guard import LinkGuard
from pdserve.handoff.source import SourceTransfer
from pdserve.handoff.states import TxnState
from pdserve.handoff.transports.base import ChunkPayload, LinkClosed, ReceiverLink, SenderLink


@dataclass(frozen=True)
class DriveConfig:
    ack_timeout_s: float = 1.0
    give_up_s: float = 30.0
    poll_s: float = 0.0005


def _payload(src: SourceTransfer, chunk_id: str) -> ChunkPayload:
    spec = src.manifest.chunk(chunk_id)
    return ChunkPayload(spec.layer, src.raw, tuple(src.chunk_src_blocks(spec)), tuple(src.manifest.chunk_dst_blocks(spec)))


def _check_cancel(src: SourceTransfer, cancelled: Callable[[], bool]) -> None:
    if cancelled():
        raise HandoffError(RejectReason.CANCELLED, src.manifest.transfer_id)


def _send_ready(src: SourceTransfer, link: SenderLink, cancelled: Callable[[], bool] = lambda: False) -> int:
    """Send every producer-ready chunk the credit window admits; returns how many were sent.
    The owner's cancel is checked before each chunk, so an abort never waits for a whole window."""
    sent = 0
    for spec in src.ready_chunks():
        if not src.credits.can_acquire(spec.nbytes):
            break
        _check_cancel(src, cancelled)
        payload = _payload(src, spec.chunk_id)
        frame = src.begin_send(spec.chunk_id, stage=lambda offset: link.stage(offset, payload))
        sent_s = src.trace.clock()
        link.send_chunk(frame, payload)
        src.mark_sent(frame, sent_s)
        sent += 1
    return sent


def _resend(src: SourceTransfer, link: SenderLink, chunk_ids: list[str],
            cancelled: Callable[[], bool] = lambda: False) -> None:
    for chunk_id in chunk_ids:
        _check_cancel(src, cancelled)
        frame = src.resend_frame(chunk_id, resend=src.log.num_resends + 1)
        sent_s = src.trace.clock()
        link.send_chunk(frame, _payload(src, chunk_id))
        src.mark_sent(frame, sent_s)


def _absorb(src: SourceTransfer, link: SenderLink, timeout_s: float) -> bool:
    """Apply every answer waiting on the link; True if any arrived."""
    got = False
    while (answer := link.recv(timeout_s if not got else 0.0)) is not None:
        got = True
        try:
            if isinstance(answer, ChunkAck):
                src.on_ack(answer)
            elif isinstance(answer, PublishAck):
                src.on_publish_ack(answer)
        except HandoffError as err:
            if err.reason not in (RejectReason.WRONG_GENERATION, RejectReason.WRONG_TRANSFER):
                raise
    return got


def drive_source(src: SourceTransfer, link: SenderLink, config: DriveConfig = DriveConfig(),
                 cancelled: Callable[[], bool] = lambda: False, capability: bytes | None = None) -> SourceTransfer:
    try:
        _drive(src, link, config, cancelled, capability)
    except LinkClosed:
        _abort_source(src, link, RejectReason.TRANSPORT_FAILURE)
    except HandoffError as err:
        _abort_source(src, link, err.reason)
    return src


def _drive(src: SourceTransfer, link: SenderLink, config: DriveConfig, cancelled: Callable[[], bool],
           capability: bytes | None) -> None:
    link.send(ManifestFrame(src.manifest, capability))  # the link's first manifest carries the capability
    sealed, last_progress, deadline = False, time.monotonic(), time.monotonic() + config.give_up_s
    while src.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
        _check_cancel(src, cancelled)
        if time.monotonic() > deadline:
            raise HandoffError(RejectReason.TIMEOUT, src.manifest.transfer_id)
        version = src.gate.version  # read before looking for work, so no report is missed below
        progressed = _send_ready(src, link, cancelled) > 0
        if src.resend_queue:
            _resend(src, link, _take(src.resend_queue), cancelled)
            progressed = True
        if not sealed and src.all_sent():
            link.send(src.seal())
            sealed = True
        waiting_on_producer = not src.all_sent() and not src.ready_chunks()
        # waiting on the producer: block on the gate (woken by the next progress report), not on
        # the link; answers are picked up at least every poll_s
        progressed |= _absorb(src, link, 0.0 if waiting_on_producer else config.ack_timeout_s / 20)
        if waiting_on_producer:
            src.gate.wait_for_more(version, config.poll_s)
        if progressed or waiting_on_producer:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > config.ack_timeout_s:
            sealed = _on_silence(src, link, sealed)
            last_progress = time.monotonic()


def _on_silence(src: SourceTransfer, link: SenderLink, sealed: bool) -> bool:
    """No answer for a while: resend the manifest (idempotent), unanswered chunks, and the seal."""
    link.send(ManifestFrame(src.manifest))
    _resend(src, link, src.unacknowledged())
    if sealed:
        link.send(src.seal())
    return sealed


def _take(queue: list[str]) -> list[str]:
    items = list(queue)
    queue.clear()
    return items


def _abort_source(src: SourceTransfer, link: SenderLink, reason: RejectReason) -> None:
    if src.state in (TxnState.PUBLISHED, TxnState.ABORTED):
        return
    frame = src.abort(reason)
    try:
        link.send(frame)
    except LinkClosed:
        pass


def await_peer_close(link: SenderLink, timeout_s: float) -> bool:
    """Read (and ignore) answers until the destination hangs up; False if it did not within
    `timeout_s`. The destination hangs up once its transaction is terminal and its last granted
    copy is over (its acknowledgement of the cancel), so a caller whose peer reads its blocks
    keeps them pinned until this returns True, however many times it has to ask."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            link.recv(0.05)
    except (LinkClosed, OSError):
        return True
    return False


def serve_destination(endpoint: DecodeEndpoint, link: ReceiverLink, transfer_id: str,
                      config: DriveConfig = DriveConfig(), until: Callable[[], bool] | None = None,
                      guard: LinkGuard | None = None) -> TxnState:
    """Answer frames until `transfer_id` is terminal (or `until()` holds); returns its final state.
    With a `guard` every frame is screened by the capability check first (guard.py)."""
    txn = endpoint.transfers[transfer_id]
    done = until or (lambda: txn.state in (TxnState.PUBLISHED, TxnState.ABORTED))
    last_frame = time.monotonic()
    landing = guard.landing if guard is not None else GrantedLanding(endpoint)
    try:
        while not done():
            frame = landing.recv(link, config.ack_timeout_s / 10)
            if frame is None:
                if time.monotonic() - last_frame > config.give_up_s:
                    raise LinkClosed("source silent")
                continue
            last_frame = time.monotonic()
            for answer in answer_frame(endpoint, link, frame, guard):
                link.send(answer)
    except LinkClosed:
        if txn.state < TxnState.PUBLISHED:
            endpoint.abort(transfer_id, RejectReason.TRANSPORT_FAILURE)
    return txn.state


def answer_frame(endpoint: DecodeEndpoint, link: ReceiverLink, frame, guard: LinkGuard | None = None, lock=None) -> list:
    """The destination's answers to one received frame: the guard's, else the endpoint's (under
    `lock`, the worker's, when given)."""
    landed = link.landed_checksum(frame) if isinstance(frame, ChunkFrame) else None
    screened = guard.screen(frame) if guard is not None else None
    if screened is not None:
        return screened
    with lock if lock is not None else contextlib.nullcontext():
        return endpoint.handle(frame, landed)
