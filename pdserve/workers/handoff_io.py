"""A worker's end of the K/V handoff: sources on prefill workers, a listener on decode workers.

Contract:
- `HandoffSender.start(...)` (prefill worker) builds the manifest for one request against the
  destination's reservation, opens a link (shm: the destination copies chunks out of this
  worker's shared pool, frames on a socket; tcp: frames and payloads on the socket) and drives
  the transfer on its own thread. The engine advances the producer gate through
  `gate(request_id)`; the thread reports
  the finished `SourceTransfer` through `on_done`.
- `HandoffListener` (decode worker) accepts one connection per transfer and answers frames with
  the worker's `DecodeEndpoint`; every endpoint call runs under the worker lock, payload bytes
  land in reserved blocks outside it. Each landing grant is ended (`end_landing`) as soon as the
  transport's receive returns or fails, so an abort meanwhile frees the blocks only after the
  write is over (quiescence). The final state is reported through `on_done`, with the
  transaction's record (its owner may `release` the endpoint's entry before the report is read).
- Bounds (handoff/limits.py): every link's header and payload sizes follow from the pool's K/V
  ABI, every socket has a read/write timeout and keepalive, and the listener's accept loop is a
  `BoundedServer` (a connection limit, transient accept errors retried). An aborted sender whose
  destination copies out of its memory (pull) reports only once that destination hung up: its
  source blocks are released then, never after a wait that merely ran out.
A fetch holder's sender reads `SourceSegments` (handoff/segments.py: its device pool and its host
tier, host slots read in place) instead of its pool alone; a pull link then announces both
segments, and the capability must name exactly the plan's (segment, slot) pairs.
Link preamble: one byte, b"P" (shm pull: the destination copies from this worker's shared pool),
b"S" (shm staging, when the pool is private) or b"T" (tcp), then frames.
Capabilities (docs/security.md): with a `Verifier` (the router's public key from the launch
config), the sender checks the plan's capability before it opens a link (its memory is read, its
bytes leave the process) and sends it in the link's first manifest; the listener lands nothing
before that manifest's capability verified against its own reservation (handoff/trust/guard.py), and
then only the admitted transfer's chunks inside the capability's blocks. A denial ends the
transfer with its `capability_*` reason on the side that denied (and, told by a refused
`PublishAck`, on the source), reported through `on_done` like any failed transfer.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from pdserve.engine.kv.kv_abi import CacheIdentity
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.trust.capability import PULL, PUSH, Verifier
from pdserve.handoff.credits import ByteCredits
from pdserve.handoff.destination import DestinationTransfer
from pdserve.handoff.driver import DriveConfig, answer_frame, await_peer_close, drive_source
from pdserve.handoff.endpoint import DecodeEndpoint, GrantedLanding
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import Frame, ManifestFrame
from pdserve.handoff.trust.guard import LinkGuard, source_expectation
from pdserve.handoff.kvbytes import pool_bytes
from pdserve.handoff.limits import DEFAULT_IO_TIMEOUT_S, link_limits
from pdserve.handoff.manifest import HandoffManifest, IdentityFence, PromptSpan, build_manifest
from pdserve.handoff.shard_map import layout_of
from pdserve.handoff.gate import LayerGate
from pdserve.handoff.source import SourceTransfer
from pdserve.handoff.segments import SourceSegments
from pdserve.handoff.states import TxnState
from pdserve.handoff.trace import TraceSink
from pdserve.ledger.kv import logical_transfer_bytes
from pdserve.handoff.transports.base import LinkClosed, ReceiverLink
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.handoff.transports.copy import ShmReceiverLink, ShmSenderLink
from pdserve.handoff.transports.pull import ShmPullReceiverLink, ShmPullSenderLink
from pdserve.handoff.transports.server import BoundedServer
from pdserve.handoff.transports.tcp import TcpReceiverLink, TcpSenderLink, tune
from pdserve.workers.messages import TransferPlan

CHUNK_TARGET_BYTES = 1 << 20
PEER_CLOSE_WAIT_S = 2.0  # a refusing destination drains its source this long before hanging up
log = logging.getLogger("pdserve.worker")


def prompt_digest(prompt_ids: tuple[int, ...] | list[int]) -> str:
    return hashlib.sha256(np.asarray(prompt_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


def transfer_blocks(src_blocks: list[int], plan: TransferPlan) -> list[int]:
    """The source blocks of the transferred prompt blocks (those not visible at the destination);
    a prefix of them while chunked prefill is still allocating."""
    return src_blocks[plan.num_visible_blocks : len(plan.dest_blocks)]


class HandoffSender:
    def __init__(self, worker_id: str, epoch: int, pool: KvPool, identity: CacheIdentity, trace: TraceSink,
                 on_done: Callable[[str, SourceTransfer, float, int], None], credit_bytes: int = 64 << 20,
                 max_concurrent: int = 4, prefill_chunk_tokens: int | None = None, verifier: Verifier | None = None,
                 sources: SourceSegments | None = None, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S):
        self.worker_id, self.epoch = worker_id, epoch
        self.limits = link_limits(pool.abi, pool.num_blocks, io_timeout_s)  # every link's bounds (handoff/limits.py)
        self.verifier = verifier  # None: this worker runs without capabilities (tests, benches)
        # transfer chunks no longer than a prefill chunk: each becomes sendable as soon as the prefill
        # chunk(s) writing it passed its layer (aligned unless the destination already had a prefix)
        self.max_chunk_blocks = max(1, prefill_chunk_tokens // pool.abi.block_size) if prefill_chunk_tokens else None
        self.pool, self.raw, self.identity, self.trace = pool, pool_bytes(pool), identity, trace
        self.sources = sources  # None: source blocks are this pool's blocks
        if sources is not None:
            self.raw = sources
        self.credit_bytes = credit_bytes
        self.on_done = on_done
        self.gates: dict[str, LayerGate] = {}
        self.cancels: dict[str, threading.Event] = {}
        self.slots = threading.BoundedSemaphore(max_concurrent)

    def gate(self, request_id: str) -> LayerGate | None:
        return self.gates.get(request_id)

    def cancel(self, request_id: str) -> bool:
        """Ask a running transfer to abort; True if one was running (its `on_done` follows, after
        which its source blocks may be released)."""
        event = self.cancels.get(request_id)
        if event is not None:
            event.set()
        return event is not None

    def manifest_for(self, request_id: str, prompt_ids: tuple[int, ...], plan: TransferPlan, tenant: str,
                     schedule: str) -> HandoffManifest:
        """The manifest `start` sends: the router's plan (generation, attempt, destination epoch and
        reservation) fenced with this worker's id and epoch; it moves exactly the ledger's bytes."""
        abi = self.pool.abi
        fence = IdentityFence(tenant, request_id, plan.generation, plan.attempt, self.worker_id, self.epoch,
                              plan.dest_worker, plan.dest_epoch, plan.reservation_id)
        span = PromptSpan(prompt_digest(prompt_ids), len(prompt_ids), plan.num_visible_blocks)
        per_chunk = max(1, CHUNK_TARGET_BYTES // (2 * abi.slab_bytes))
        if self.max_chunk_blocks:
            per_chunk = min(per_chunk, self.max_chunk_blocks)
        manifest = build_manifest(plan.transfer_id, fence, span, self.identity, abi,
                                  list(plan.dest_blocks[plan.num_visible_blocks:]), per_chunk, schedule, layout_of(self.pool))
        expected = logical_transfer_bytes(manifest.num_transfer_blocks, abi.block_size, abi.num_layers,
                                          abi.num_kv_heads, abi.head_dim, abi.dtype_bytes)
        if manifest.total_bytes != expected:  # the chunk plan must move exactly the ledger's transfer set
            raise ValueError(f"manifest moves {manifest.total_bytes} bytes, the ledger says {expected}")
        return manifest

    def start(self, request_id: str, prompt_ids: tuple[int, ...], src_blocks: list[int], plan: TransferPlan,
              tenant: str, schedule: str) -> SourceTransfer:
        abi = self.pool.abi
        manifest = self.manifest_for(request_id, prompt_ids, plan, tenant, schedule)
        gate = LayerGate(abi.num_layers, clock=time.monotonic)
        self.gates[request_id] = gate
        self.cancels[request_id] = threading.Event()
        blocks = transfer_blocks(src_blocks, plan)
        # one credit window per transfer, no larger than its payload: with shm it is also the size
        # of the staging area the destination maps for this link
        credits = ByteCredits(max(1, min(self.credit_bytes, manifest.total_bytes)))
        src = SourceTransfer(manifest, self.raw, blocks, credits, gate, self.trace, worker=self.worker_id)
        threading.Thread(target=self._run, args=(request_id, src, plan), daemon=True, name=f"send-{request_id}").start()
        return src

    def _run(self, request_id: str, src: SourceTransfer, plan: TransferPlan) -> None:
        t0 = time.monotonic()
        with self.slots:  # a few transfers at a time: dozens of threads only fight for the GIL
            link = self._connect(src, plan)
            if link is not None:
                self._drive(request_id, src, plan, link)
        physical = 0
        if link is not None:
            if src.state is TxnState.ABORTED and link.peer_reads_source:
                self._await_hang_up(src, link)  # outside the slot: a silent peer holds its blocks, not a slot
            physical = link.traffic.snapshot.total_bytes
            link.close()
        self.gates.pop(request_id, None)
        self.cancels.pop(request_id, None)
        self.on_done(request_id, src, time.monotonic() - t0, physical)

    def _drive(self, request_id: str, src: SourceTransfer, plan: TransferPlan, link) -> None:
        cancel = self.cancels[request_id]
        try:
            drive_source(src, link, DriveConfig(ack_timeout_s=2.0, give_up_s=30.0), cancelled=cancel.is_set,
                         capability=plan.capability)
        except Exception as exc:  # noqa: BLE001 - a broken link must still end the transaction
            log.warning("handoff %s failed: %r", src.manifest.transfer_id, exc)
            if src.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
                src.abort(RejectReason.TRANSPORT_FAILURE)

    def _await_hang_up(self, src: SourceTransfer, link) -> None:
        """A pull destination copies out of this pool: the source blocks stay pinned until it hung
        up (it does once its transaction is terminal and no copy runs: the cancel's acknowledgement).
        A destination that stays connected and silent keeps them pinned; the router's supervision
        ends such a worker, which closes the link (docs/security.md)."""
        wait_s = self.limits.io_timeout_s or DEFAULT_IO_TIMEOUT_S
        while not await_peer_close(link, wait_s):
            log.warning("handoff %s: aborted, the destination has not hung up; source blocks stay pinned",
                        src.manifest.transfer_id)

    def _direction(self, plan: TransferPlan) -> str:
        return PULL if plan.transport == "shm" and self.pool.shm_name is not None else PUSH

    def _connect(self, src: SourceTransfer, plan: TransferPlan):
        """The transfer's link once its capability verified, else None with the source aborted."""
        try:
            if self.verifier is not None:
                segments = tuple(n for n in self.sources.names if n) if self.sources is not None else ()
                self.verifier.verify(plan.capability, source_expectation(
                    src.manifest, self.worker_id, self.epoch, self.pool.abi.abi_hash, self._direction(plan),
                    segments if plan.src_slots else None, plan.src_slots or None))
            return self._open_link(plan, src.credits.capacity_bytes)
        except HandoffError as err:
            log.warning("handoff %s denied at the source: %s", src.manifest.transfer_id, err)
            src.abort(err.reason)
        except OSError as exc:
            log.warning("handoff link to %s failed: %r", plan.dest_worker, exc)
            src.abort(RejectReason.TRANSPORT_FAILURE)
        return None

    def _open_link(self, plan: TransferPlan, window: int):
        """Connect with a bounded wait; the channel then puts the link's read/write timeout on it."""
        sock = tune(socket.create_connection(tuple(plan.dest_address), timeout=self.limits.io_timeout_s))
        if plan.transport == "shm" and self.pool.shm_name is not None:  # pull from this pool's segment
            sock.sendall(b"P")
            extra = () if self.sources is None else tuple(
                (name, raw.shape[2]) for name, raw in zip(self.sources.names[1:], self.sources.raws[1:]) if name)
            return ShmPullSenderLink(SocketChannel(sock, self.limits), self.pool.shm_name, self.pool.num_blocks, extra)
        if plan.transport == "shm":
            sock.sendall(b"S")
            return ShmSenderLink(SocketChannel(sock, self.limits), window)
        sock.sendall(b"T")
        return TcpSenderLink(sock, self.limits)


def _land_nothing(frame) -> None:
    return None


def _hang_up(link: ReceiverLink, timeout_s: float) -> None:
    """Half-close after a refusal, then discard what the source still sends until it hangs up
    (closing with unread bytes would reset the connection and could drop the refusal)."""
    link.handshakes_closed = True  # a pull source's pool announced now is never mapped
    try:
        link.channel.sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            link.recv(0.05, _land_nothing)
    except (LinkClosed, OSError):
        pass


class _FirstFrameLink(ReceiverLink):
    """Replays the manifest frame the listener read to learn the transfer id."""

    def __init__(self, inner: ReceiverLink, first: Frame):
        super().__init__()
        self.inner, self.first = inner, first

    def recv(self, timeout_s, landing):
        if self.first is not None:
            frame, self.first = self.first, None
            return frame
        return self.inner.recv(timeout_s, landing)

    def send(self, frame: Frame) -> None:
        self.inner.send(frame)

    def landed_checksum(self, frame):
        return self.inner.landed_checksum(frame)

    def close(self) -> None:
        self.inner.close()


class HandoffListener:
    """A bounded server (handoff/transports/server.py: connection limit, accept queue, timeouts,
    keepalive) whose connections are links into `endpoint`, each bounded by the pool's limits."""

    def __init__(self, endpoint: DecodeEndpoint, lock: threading.RLock, host: str,
                 on_done: Callable[[str, TxnState, DestinationTransfer], None], give_up_s: float = 30.0, verifier: Verifier | None = None,
                 io_timeout_s: float = DEFAULT_IO_TIMEOUT_S, max_connections: int | None = None):
        self.endpoint, self.lock, self.on_done = endpoint, lock, on_done
        self.give_up_s = give_up_s
        self.verifier = verifier  # None: no capability check (tests, benches); `pdserve serve` always sets one
        self.limits = link_limits(endpoint.pool.abi, endpoint.pool.num_blocks, io_timeout_s)
        extra = {} if max_connections is None else {"max_connections": max_connections}
        self.server = BoundedServer(host, self._serve, io_timeout_s, **extra)
        self.address = self.server.address

    def _serve(self, conn: socket.socket, admit: Callable[[], bool]) -> None:
        # the preamble byte and the link's first frame (it names its transfer and lands nothing)
        # must arrive whole within one I/O timeout in total, so a silent or trickling (slow-loris)
        # peer frees its place soon; until then it holds no service slot (BoundedServer: pending)
        wait_s = self.limits.io_timeout_s or self.give_up_s
        deadline = time.monotonic() + wait_s
        try:
            conn.settimeout(wait_s)
            kind = conn.recv(1)
            if kind == b"P":
                link = ShmPullReceiverLink(SocketChannel(conn, self.limits), self.endpoint.raw)
            elif kind == b"S":  # under capabilities the staging segment exists only once the link is admitted
                link = ShmReceiverLink(SocketChannel(conn, self.limits), self.endpoint.raw, deferred=self.verifier is not None)
            elif kind == b"T":
                link = TcpReceiverLink(conn, self.endpoint.raw, self.limits)
            else:
                return  # not a handoff peer (the server closes the connection)
            left_s = max(0.0, deadline - time.monotonic())
            link.channel.expect_within(left_s)
            first = link.recv(left_s, _land_nothing)
            link.channel.expect_within(None)
        except (OSError, LinkClosed):
            return
        transfer_id = first.manifest.transfer_id if isinstance(first, ManifestFrame) else None
        if transfer_id is not None and self.verifier is not None and self._turned_away(link, first, transfer_id):
            return
        if transfer_id is None or not self._claim(transfer_id):
            link.close()
            return
        if not admit():
            self._unclaim(transfer_id)
            link.close()
            return
        try:
            guard = None if self.verifier is None else \
                LinkGuard(self.verifier, self.endpoint, transfer_id, PULL if kind == b"P" else PUSH, self.lock,
                          on_admit=getattr(link, "open_staging", None), on_claims=getattr(link, "bind", None))
            txn = self.endpoint.transfers[transfer_id]
            state = self._answer(_FirstFrameLink(link, first), transfer_id, guard)
            if guard is not None and guard.refused:
                _hang_up(link, PEER_CLOSE_WAIT_S)  # the source reads the refusal's reason before the link goes
            link.close()
        finally:
            self._unclaim(transfer_id)  # a link that raised must not keep its transfer from a retry
        self.on_done(transfer_id, state, txn)  # the record itself: its owner may release it meanwhile

    def _turned_away(self, link, first: ManifestFrame, transfer_id: str) -> bool:
        """A first manifest whose capability is not the issuer's is answered and closed before its
        link may claim the transfer: a forger racing the real source never holds the one claim
        (the real source's link would be closed unanswered: a transport failure), and it holds no
        service slot while it is drained (it is still pending in the BoundedServer)."""
        reason = self.verifier.unauthenticated(first.capability)
        if reason is None:
            return False
        with self.lock:
            txn = self.endpoint.transfers.get(transfer_id)
            unclaimable = txn is None or txn.state >= TxnState.PUBLISHED or self.endpoint.carried(transfer_id)
            ack = None if unclaimable else self.endpoint.turn_away(transfer_id, reason)  # as `_claim`: closed unanswered
        if ack is not None:
            log.warning("handoff %s: a link without the issuer's capability was turned away (%s)", transfer_id, reason.value)
            try:
                link.send(ack)
            except (OSError, LinkClosed):
                pass
            else:
                _hang_up(link, PEER_CLOSE_WAIT_S)
        link.close()
        return True

    def _claim(self, transfer_id: str) -> bool:
        """Take `transfer_id` for this link (`DecodeEndpoint.claim`): one link and one report
        (`on_done`) per transfer. A peer naming a finished transfer or one a link already carries
        is closed before it holds a slot, and never reaches the transaction."""
        with self.lock:
            return self.endpoint.claim(transfer_id)

    def _unclaim(self, transfer_id: str) -> None:
        with self.lock:
            self.endpoint.unclaim(transfer_id)

    def _answer(self, link: ReceiverLink, transfer_id: str, guard: LinkGuard | None) -> TxnState:
        txn = self.endpoint.transfers[transfer_id]
        landing = guard.landing if guard is not None else GrantedLanding(self.endpoint, self.lock)
        last = time.monotonic()
        try:
            while txn.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
                frame = landing.recv(link, 0.1)
                if frame is None:
                    if time.monotonic() - last > self.give_up_s:
                        raise LinkClosed("source silent")
                    continue
                last = time.monotonic()
                for answer in answer_frame(self.endpoint, link, frame, guard, self.lock):
                    link.send(answer)
        except Exception as exc:  # noqa: BLE001 - any failure on this link ends the unpublished transfer
            if not isinstance(exc, (LinkClosed, OSError)):
                log.warning("handoff listener for %s failed: %r", transfer_id, exc)
            with self.lock:
                if txn.state < TxnState.PUBLISHED:
                    self.endpoint.abort(transfer_id, RejectReason.TRANSPORT_FAILURE)
        if txn.terminal_reason is not None and txn.terminal_reason.value.startswith("capability_"):
            log.warning("handoff %s denied at the destination: %s", transfer_id, txn.terminal_reason.value)
        return txn.state

    def close(self) -> None:
        self.server.close()
