"""Cross-worker prefix fetch, a worker's side of it (issue 19, parts 2 to 4).

A fetch is one handoff transaction whose source is a worker that holds a prefix in its prefix
cache (the holder) and whose destination is the worker about to prefill a request that lacks it:
the same manifest with its identity fence, byte credits, validation, atomic publication and
capability as a prefill -> decode handoff (workers/handoff_io.py), over the same transports.

Destination (router -> FetchReserve):
    its own leading hit is acquired (pinned), fresh blocks are allocated for the rest of the
    prefix, the endpoint reserves them under the fetch id -> FetchReserved(blocks) to the router
    the holder's link lands chunks, validates, publishes once -> transfer-with-insert: every
    fetched block enters this worker's prefix cache under its chain hash, then every pin is
    dropped (the blocks stay cached, evictable) -> FetchDone(side="destination", published)
    FetchAbort, a failed link or an expired lease -> the unpublished reservation returns its
    blocks through the endpoint's one abort path; nothing is registered, nothing read.
Holder (router -> FetchPin, then FetchServe(plan)): workers/prefix_fetch/fetch_holder.py pins the prefix's
    blocks where they are (device blocks; host-tier slots, read in place by the peer) under a
    lease, serves the plan's (segment, slot) pairs and drops the pins when the sender ends.
Every call that touches the block manager runs under the worker lock; `tables()` lists the
blocks a fetch pins so the engine's integrity check counts them (Engine.external_tables).
The router's fetch messages reach `handle` on the fetch control thread (workers/prefix_fetch/fetch_control.py,
its own socket), so reserve, pin, serve and abort wait only for the worker lock, which the engine
releases during each forward, never for the engine step itself; `handle` returns the reply and
the caller sends it on its own socket (the main loop handles the same messages when the router
reaches the worker only through its main socket).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.handoff.destination import DestinationTransfer, ReserveRequest
from pdserve.handoff.endpoint import DecodeEndpoint
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.leases import LeaseTable
from pdserve.handoff.limits import io_timeout_for_lease
from pdserve.handoff.reservations import Reservation
from pdserve.handoff.states import TxnState
from pdserve.workers import messages as m
from pdserve.workers.prefix_fetch.fetch_holder import FetchHolder
from pdserve.workers.handoff_io import HandoffListener, prompt_digest

log = logging.getLogger("pdserve.worker")
FETCH_GENERATION = 1  # a fetch is never rerouted: one generation, one attempt


@dataclass(frozen=True)
class PinnedPrefix:
    """Destination blocks of one fetch: `visible` already cached here (pinned), `fresh` to land."""

    visible: tuple[int, ...]
    fresh: tuple[int, ...]
    hashes: tuple[bytes, ...]  # chain hashes of every prefix block (the tenant's root)
    tokens: tuple[int, ...]  # the prefix's token ids (whole blocks)

    @property
    def blocks(self) -> list[int]:
        return [*self.visible, *self.fresh]


def pin_prefix(manager, hashes: list[bytes], tokens, limit: int) -> list[int] | None:
    """Take a reference on up to `limit` leading cached blocks (device, then the host tier's,
    promoted), or None when reviving the unreferenced device blocks among them would eat into
    capacity reserved for others (a revived block leaves the free count; reservations must stay
    within it; a promotion allocates, which checks the same room)."""
    n = min(manager.match_prefix(hashes, tokens), limit)
    revived = sum(1 for h in hashes[:n] if manager.refcount[manager.cached[h]] == 0)
    if revived > manager.available_for(None):
        return None
    return manager.acquire_prefix(hashes, tokens, limit=limit)


class FetchBlocks:
    """The handoff's `DestinationBlocks` over a fetch's pinned blocks (engine block manager)."""

    def __init__(self, engine):
        self.manager = engine.blocks
        self._expected: dict[str, PinnedPrefix] = {}  # fetch id -> pins, until the endpoint reserves
        self._held: dict[str, PinnedPrefix] = {}  # reservation id -> pins

    def expect(self, fetch_id: str, pinned: PinnedPrefix) -> None:
        self._expected[fetch_id] = pinned

    def can_reserve(self, num_blocks: int) -> bool:
        return True  # the blocks were allocated before the endpoint reserves

    def reserve(self, owner: str, num_prompt_blocks: int, num_growth_blocks: int = 0) -> Reservation:
        pinned = self._expected.pop(owner, None)
        if pinned is None or len(pinned.fresh) != num_prompt_blocks or num_growth_blocks:
            if pinned is not None:
                self.manager.release(pinned.blocks)
            raise HandoffError(RejectReason.RESERVATION_EXHAUSTED, f"no fetch blocks for {owner}")
        reservation = Reservation(f"{owner}/res", owner, pinned.fresh, len(pinned.fresh))
        self._held[reservation.reservation_id] = pinned
        return reservation

    def insert(self, reservation_id: str) -> int:
        """Transfer-with-insert: the published blocks enter the prefix cache; returns how many."""
        pinned, bs = self._held[reservation_id], self.manager.block_size
        first = len(pinned.visible)
        for j, block in enumerate(pinned.fresh, start=first):
            self.manager.register(block, pinned.hashes[j], tuple(pinned.tokens[j * bs:(j + 1) * bs]))
        return len(pinned.fresh)

    def free(self, reservation_id: str) -> None:
        if reservation_id not in self._held:
            raise HandoffError(RejectReason.WRONG_RESERVATION, f"{reservation_id} is not reserved")
        self.manager.release(self._held.pop(reservation_id).blocks)

    def drop_expected(self, fetch_id: str) -> None:
        pinned = self._expected.pop(fetch_id, None)
        if pinned is not None:
            self.manager.release(pinned.blocks)

    def is_reserved(self, reservation_id: str) -> bool:
        return reservation_id in self._held

    def tables(self) -> list[list[int]]:
        return [p.blocks for p in (*self._expected.values(), *self._held.values())]

    def assert_no_leaks(self) -> None:
        assert not self._expected and not self._held, f"fetch pins held: {sorted(self._expected)} {sorted(self._held)}"


class FetchSide:
    """Both ends of fetches on one worker (any role): a listener for prefixes it receives and a
    sender for prefixes it holds."""

    def __init__(self, worker):
        self.worker, self.engine = worker, worker.engine
        self.blocks = FetchBlocks(self.engine)
        self.endpoint = DecodeEndpoint(worker.id, worker.epoch, self.engine.pool, self.blocks, self.engine.identity,
                                       trace=worker.trace)
        self.listener = HandoffListener(self.endpoint, worker.lock, worker.config.handoff_host, verifier=worker.verifier,
                                        io_timeout_s=io_timeout_for_lease(worker.config.lease_s),
                                        on_done=lambda tid, state, txn: worker.events.put(("fetch_dest", (txn, state))))
        self.leases = LeaseTable(worker.config.lease_s)
        self.holder = FetchHolder(worker, self.leases, pin_prefix)
        self.sender = self.holder.sender
        self._next_lease_check = 0.0

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    def handle(self, msg: m.FetchReserve | m.FetchPin | m.FetchServe | m.FetchAbort) -> m.ToRouter | None:
        """One router fetch message; the reply to send (None: nothing to say now)."""
        if isinstance(msg, m.FetchReserve):
            with self.worker.lock:
                return self._reserve(msg)
        if isinstance(msg, m.FetchPin):
            return self.holder.pin(msg)
        if isinstance(msg, m.FetchServe):
            return self.holder.serve(msg)
        return self.abort(msg.fetch_id)

    def receive(self, msg: m.FetchReserve | m.FetchPin | m.FetchServe | m.FetchAbort) -> None:
        """`handle` from the main loop: the reply goes out on the worker's main socket."""
        reply = self.handle(msg)
        if reply is not None:
            self.worker.send(reply)

    # ---- destination ----------------------------------------------------------------------

    def _reserve(self, msg: m.FetchReserve) -> m.FetchReserved:
        me, bm, ids = self.worker, self.engine.blocks, msg.prompt_ids
        n = len(ids) // bm.block_size
        hashes = bm.hashes_for(ids, msg.tenant)[:n]
        visible = pin_prefix(bm, hashes, ids, n)
        if visible is None:
            return m.FetchReserved(me.id, me.epoch, msg.fetch_id, False, "no_kv_capacity")
        if len(visible) == n or not bm.can_allocate(n - len(visible)):
            bm.release(visible)
            reason = "nothing_to_fetch" if len(visible) == n else "no_kv_capacity"
            return m.FetchReserved(me.id, me.epoch, msg.fetch_id, False, reason)
        pinned = PinnedPrefix(tuple(visible), tuple(bm.allocate(n - len(visible))), tuple(hashes), tuple(ids[: n * bm.block_size]))
        self.blocks.expect(msg.fetch_id, pinned)
        request = ReserveRequest(msg.fetch_id, msg.tenant, msg.fetch_id, FETCH_GENERATION, m.FIRST_ATTEMPT, msg.holder,
                                 msg.holder_epoch, prompt_digest(pinned.tokens), len(pinned.tokens), len(pinned.fresh),
                                 reused_block_ids=pinned.visible)
        try:
            reservation = self.endpoint.reserve(request)
        except HandoffError as err:
            self.blocks.drop_expected(msg.fetch_id)
            return m.FetchReserved(me.id, me.epoch, msg.fetch_id, False, err.reason.value)
        self.leases.grant(msg.fetch_id, time.monotonic())
        return m.FetchReserved(me.id, me.epoch, msg.fetch_id, True, None, tuple(pinned.blocks), len(visible),
                               reservation.reservation_id)

    def _landed(self, txn: DestinationTransfer, state: TxnState) -> m.FetchDone | None:
        fetch_id, inserted = txn.transfer_id, 0
        with self.worker.lock:
            if self.endpoint.transfers.get(fetch_id) is not txn:
                return None  # reported already (its record released)
            self.leases.drop(fetch_id)
            if state is TxnState.PUBLISHED:
                inserted = self.blocks.insert(txn.reservation.reservation_id)
                self.endpoint.retire(fetch_id)  # the pins drop; the blocks stay cached (and the record goes)
            self.endpoint.release(fetch_id)
        reason = None if inserted else (txn.terminal_reason.value if txn.terminal_reason else "aborted")
        return m.FetchDone(self.worker.id, self.worker.epoch, fetch_id, "destination", bool(inserted), reason, blocks=inserted)

    def abort(self, fetch_id: str, reason: RejectReason = RejectReason.CANCELLED) -> m.FetchDone | None:
        """The router gave up on a fetch (FetchAbort) or its lease expired: an unpublished
        reservation returns its blocks; a holder stops reading. The destination's FetchDone
        when no link will report the abort."""
        with self.worker.lock:
            self.leases.drop(fetch_id)
            txn = self.endpoint.transfers.get(fetch_id)
            if txn is not None and txn.state < TxnState.PUBLISHED:
                self.endpoint.abort(fetch_id, reason)
            self.holder.abort(fetch_id)
        if txn is not None and txn.quiescent and txn.state is TxnState.ABORTED:
            return self._landed(txn, TxnState.ABORTED)  # no link will report it
        return None

    # ---- worker loop ----------------------------------------------------------------------
    def on_event(self, kind: str, payload) -> None:
        reply = self._landed(*payload) if kind == "fetch_dest" else self.holder.served(*payload)
        if reply is not None:
            self.worker.send(reply)

    def tick(self) -> None:
        """Expire the leases of fetches nobody finished (every 0.2 s)."""
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + 0.2
        for fetch_id in self.leases.expired(now):
            log.warning("worker %s: fetch %s lease expired, aborting it", self.worker.id, fetch_id)
            reply = self.abort(fetch_id, RejectReason.CANCELLED)
            if reply is not None:
                self.worker.send(reply)

    def tables(self) -> list[list[int]]:
        return self.blocks.tables() + self.holder.tables()

    @property
    def busy(self) -> bool:
        """A fetch still pins blocks here (a role change waits for it: its links touch the pool)."""
        return self.holder.busy or bool(self.blocks.tables())

    def assert_no_leaks(self) -> None:
        self.blocks.assert_no_leaks()
        self.holder.assert_no_leaks()
        self.endpoint.assert_no_leaks()

    def close(self) -> None:
        self.listener.close()
