"""The holder's side of a cross-worker prefix fetch (issue 19, parts 2-4): pin, serve, release.

Contract (every call that touches the block manager or the host tier runs under the worker lock):
    FetchPin(prompt, tenant, n) -> `pin`: the prefix's leading n blocks are pinned where they are,
    under the fetch's lease: device-cached blocks take a reference (no eviction while read), the
    rest, from the first device miss on, are host-tier slots pinned in place (engine/kv/host_tier.py:
    neither the tier's LRU eviction nor a promotion reuses a pinned slot). Fewer than n ->
    FetchPinned(ok=False, "holder_miss") (or "holder_busy": reviving a device block would eat
    capacity reserved for others) and nothing stays pinned; else FetchPinned with the (segment,
    slot) pair of each block: segment 0 the device pool, 1 the host tier (Register.shm_name,
    Register.host_shm_name), which the router names in the plan and binds into the capability.
    FetchServe(plan) -> `serve`: the plan's `src_slots` must be exactly the pins of the blocks it
    transfers (else FetchDone(failed, "source_mismatch")); the sender then reads them in place
    through `SourceSegments` (handoff/segments.py; the pull link maps both segments, the
    destination copies host slots straight into its pool and checks them as any chunk). A
    FetchServe without a FetchPin (tests, bench) pins first; one for a fetch that already ended
    (aborted, lease expired, served) is refused ("aborted"). The gate is all ready: cached
    blocks are final.
    The sender's end -> `served`: every pin drops (the host slots count as in-place reads when
    published) -> FetchDone(side="source"). `abort` (FetchAbort, an expired lease) cancels a
    running sender (its pins drop when it ends: it may be mid-read) or drops the pins of a fetch
    that was pinned and never served.
`tables()` lists the device blocks pinned so the engine's integrity check counts them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.handoff.kvbytes import pool_bytes
from pdserve.handoff.leases import LeaseTable
from pdserve.handoff.limits import io_timeout_for_lease
from pdserve.handoff.segments import SourceSegments
from pdserve.handoff.states import TxnState
from pdserve.workers import messages as m
from pdserve.workers.handoff_io import HandoffSender

DEVICE, HOST = 0, 1  # source segments of a holder: its device pool, its host tier
ENDED_KEPT = 4096  # ended fetch ids remembered, so a late FetchServe pins nothing again


@dataclass(frozen=True)
class HolderPins:
    """One fetch's pins at the holder, in prefix order: device blocks, then host slots."""

    device: tuple[int, ...]  # device blocks referenced
    host: tuple[int, ...]  # host-tier slots pinned

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple((DEVICE, b) for b in self.device) + tuple((HOST, s) for s in self.host)


def holder_sources(engine) -> SourceSegments:
    """The address space a holder's fetches read: its device pool, then its host tier if any."""
    host = engine.blocks.host
    pools = [engine.pool] + ([host.pool] if host is not None else [])
    return SourceSegments([pool_bytes(p) for p in pools], [p.shm_name for p in pools])


def pin_in_place(manager, hashes: list[bytes], tokens, n: int, revive_ok) -> HolderPins | str:
    """Pin the leading `n` blocks where they are, or the reason none stay pinned."""
    k = min(manager.match_prefix(hashes, tokens), n)
    device = revive_ok(manager, hashes, tokens, k)  # workers/prefix_fetch/fetch.py pin_prefix: no promotion at limit k
    if device is None:
        return "holder_busy"
    host, bs = [], manager.block_size
    for j in range(k, n):
        slot = manager.host.pin(hashes[j], tuple(tokens[j * bs:(j + 1) * bs])) if manager.host is not None else None
        if slot is None:
            break
        host.append(slot)
    if len(device) + len(host) < n:
        manager.release(device)
        for slot in host:
            manager.host.unpin(slot)
        return "holder_miss"
    return HolderPins(tuple(device), tuple(host))


class FetchHolder:
    def __init__(self, worker, leases: LeaseTable, revive_ok):
        self.worker, self.engine, self.leases = worker, worker.engine, leases
        self.revive_ok = revive_ok
        self.sources = holder_sources(self.engine)
        self.sender = HandoffSender(worker.id, worker.epoch, self.engine.pool, self.engine.identity, worker.trace,
                                    on_done=lambda fid, src, dt, phys: worker.events.put(("fetch_source", (fid, src, dt, phys))),
                                    verifier=worker.verifier, sources=self.sources,
                                    io_timeout_s=io_timeout_for_lease(worker.config.lease_s))
        self.pinned: dict[str, HolderPins] = {}  # fetch id -> pins (pinned, served or not)
        self.serving: set[str] = set()  # fetch ids whose sender runs
        self.ended: OrderedDict[str, None] = OrderedDict()  # aborted or served fetch ids, the most recent

    def _pin(self, fetch_id: str, prompt_ids, tenant: str, n: int) -> HolderPins | str:
        bm = self.engine.blocks
        pins = pin_in_place(bm, bm.hashes_for(prompt_ids, tenant)[:n], prompt_ids, n, self.revive_ok)
        if isinstance(pins, HolderPins):
            self.pinned[fetch_id] = pins
            self.leases.grant(fetch_id, time.monotonic())
        return pins

    def pin(self, msg: m.FetchPin) -> m.FetchPinned:
        me = self.worker
        with me.lock:
            if msg.fetch_id in self.pinned:
                return m.FetchPinned(me.id, me.epoch, msg.fetch_id, False, "duplicate_fetch")
            pins = self._pin(msg.fetch_id, msg.prompt_ids, msg.tenant, msg.num_blocks)
        if isinstance(pins, str):
            return m.FetchPinned(me.id, me.epoch, msg.fetch_id, False, pins)
        return m.FetchPinned(me.id, me.epoch, msg.fetch_id, True, None, pins.pairs)

    def serve(self, msg: m.FetchServe) -> m.FetchDone | None:
        """Start the sender; the source's failed FetchDone when it cannot start (else it comes at its end)."""
        plan, me = msg.plan, self.worker
        n = len(plan.dest_blocks)
        with me.lock:
            if plan.transfer_id in self.ended:  # its lease expired, or it was aborted or served already
                return m.FetchDone(me.id, me.epoch, plan.transfer_id, "source", False, "aborted")
            pins = self.pinned.get(plan.transfer_id) or self._pin(plan.transfer_id, msg.prompt_ids, plan.tenant, n)
            reason = pins if isinstance(pins, str) else self._mismatch(pins, plan)
            if reason is not None:
                if not isinstance(pins, str):
                    self._unpin(plan.transfer_id)
                return m.FetchDone(me.id, me.epoch, plan.transfer_id, "source", False, reason)
            addresses = [self.sources.address(seg, slot) for seg, slot in pins.pairs]
            self.serving.add(plan.transfer_id)
            self.sender.start(plan.transfer_id, msg.prompt_ids, addresses, plan, plan.tenant, "serialized")
        gate = self.sender.gate(plan.transfer_id)
        if gate is not None:
            gate.mark_all_ready()  # cached blocks are final: every layer may be read now
        return None

    @staticmethod
    def _mismatch(pins: HolderPins, plan: m.TransferPlan) -> str | None:
        if len(pins.pairs) != len(plan.dest_blocks):
            return "holder_miss"
        if plan.src_slots and tuple(map(tuple, plan.src_slots)) != pins.pairs[plan.num_visible_blocks:]:
            return "source_mismatch"  # the plan names blocks this holder did not pin for it
        return None

    def _unpin(self, fetch_id: str) -> HolderPins | None:
        self.ended[fetch_id] = None
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        pins = self.pinned.pop(fetch_id, None)
        self.leases.drop(fetch_id)
        if pins is not None:
            self.engine.blocks.release(list(pins.device))
            for slot in pins.host:
                self.engine.blocks.host.unpin(slot)
        return pins

    def served(self, fetch_id: str, src, transfer_s: float, physical: int) -> m.FetchDone:
        published = src.state is TxnState.PUBLISHED
        with self.worker.lock:
            self.serving.discard(fetch_id)
            pins = self._unpin(fetch_id)
            if published and pins is not None and pins.host:
                self.engine.blocks.host.num_inplace_reads += len(pins.host)
        reason = None if published else (src.terminal_reason.value if src.terminal_reason else "aborted")
        return m.FetchDone(self.worker.id, self.worker.epoch, fetch_id, "source", published, reason,
                           bytes=src.manifest.total_bytes if published else 0, physical_bytes=physical, transfer_s=transfer_s)

    def abort(self, fetch_id: str) -> None:
        """Under the worker lock: a running sender stops (its pins drop when it ends); pins of a
        fetch never served drop now."""
        if fetch_id in self.serving:
            self.sender.cancel(fetch_id)
        else:
            self._unpin(fetch_id)

    def tables(self) -> list[list[int]]:
        return [list(p.device) for p in self.pinned.values()]

    @property
    def busy(self) -> bool:
        return bool(self.pinned)

    def assert_no_leaks(self) -> None:
        assert not self.pinned and not self.serving, f"holder pins held: {sorted(self.pinned)}"
        if self.engine.blocks.host is not None:
            self.engine.blocks.host.assert_no_pins()
