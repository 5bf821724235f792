"""A prefill worker's part in a KV-Runahead chain: receive the prefix, compute the partition over it.

Life cycle of stage i > 0 of one request here (stage 0 is an ordinary prefill-only request):
    ReserveKv(chain_start=s) -> engine blocks for prompt[:s] and capacity for the stage's own rows
        (engine/prefix_import.py) and an endpoint reservation for the chain link from stage i-1
        -> Reserved(blocks, reservation id) to the router
    Prefill(chain=stage) -> the plan is the PrefillSide's (it sends this stage's K/V onward:
        to stage i+1, or from the last stage to the decode worker, as any prefill does)
    the link's layer 0 lands -> the stage is admitted to the engine (`poll`), which runs its rows
        in the engine's own chunks; before each later layer the forward waits in `wrap`'s hook
        until that layer of the prefix has landed
    link PUBLISHED -> the directory entry is closed (the sequence already owns the blocks)
The link is an ordinary handoff transfer (the same manifests, fences, credits, capabilities,
validation and publication, over the same `HandoffListener`), addressed to this worker.
Failure: the link aborts, lands nothing for `wait_s`, or dies mid-forward -> the stage is aborted
here (its blocks back once no write into them is in flight: an unadmitted stage's reservation
through the endpoint's release, an admitted stage's sequence by `Worker.finish_abort` once `poll`
sees the link quiescent; an onward transfer is cancelled)
and `WorkerError(code="runahead_failed")` tells the router, which re-runs the request as a
single-worker prefill. A forward waiting on a broken link raises `ChainBroken` out of the step:
the step's results are dropped (so no block of it is published to the prefix cache) and the
other sequences simply run again. Inner stages' first tokens are never sent to the router.
"""

from __future__ import annotations

import logging
import threading
import time

from pdserve.engine.errors import InvalidRequest
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.prefix_import import admit_prefix, reserve_prefix
from pdserve.handoff.destination import DestinationTransfer, ReserveRequest
from pdserve.handoff.endpoint import DecodeEndpoint
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.limits import io_timeout_for_lease
from pdserve.handoff.states import TxnState
from pdserve.workers import messages as m
from pdserve.workers.handoff_io import HandoffListener, prompt_digest
from pdserve.workers.kv_blocks import EngineDestinationBlocks

log = logging.getLogger("pdserve.worker")
FAILED = "runahead_failed"


class ChainBroken(Exception):
    """A chain stage's prefix will not arrive: the step computing it must not be applied."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"{request_id}: {reason}")
        self.request_id, self.reason = request_id, reason


def landed_layers(txn: DestinationTransfer | None) -> int:
    """How many leading layers of a link have every chunk accepted (in the pool, checksummed)."""
    if txn is None or txn.manifest is None:
        return 0
    missing = {c.layer for c in txn.manifest.chunks if c.chunk_id not in txn.accepted}
    return min(missing) if missing else txn.manifest.abi.num_layers


def layer_landed(txn: DestinationTransfer | None, layer: int) -> bool:
    """May the forward compute `layer` (it reads that layer of the prefix)? Layers past the
    model's last are always landed."""
    if txn is not None and txn.manifest is not None and layer >= txn.manifest.abi.num_layers:
        return True
    return landed_layers(txn) > layer


class Link:
    """One stage's incoming chain link (under the worker lock)."""

    def __init__(self, order: m.ReserveKv, reservation_id: str, txn: DestinationTransfer, now: float):
        self.order, self.reservation_id = order, reservation_id
        self.txn = txn  # the link's transaction (its endpoint record may be released before the link is dropped)
        self.stage: m.Prefill | None = None  # the Prefill, once it came
        self.admitted = False
        self.num_landed, self.progress_at = 0, now  # chunks accepted, and when that count last moved

    def stalled(self, txn: DestinationTransfer | None, now: float, wait_s: float) -> bool:
        """Nothing landed for `wait_s` (an upstream that is merely queued or computing slowly still
        counts as stalled only after that long; a dead one aborts the link at once)."""
        landed = 0 if txn is None else len(txn.accepted)
        if landed > self.num_landed:
            self.num_landed, self.progress_at = landed, now
        return now - self.progress_at > wait_s


class RunaheadSide:
    def __init__(self, worker, wait_s: float = 120.0):
        self.worker, self.engine, self.wait_s = worker, worker.engine, wait_s
        self.blocks = EngineDestinationBlocks(self.engine)
        self.landed = threading.Condition()
        self.endpoint = DecodeEndpoint(worker.id, worker.epoch, self.engine.pool, self.blocks, self.engine.identity,
                                       trace=worker.trace, make_visible=self._on_landed)
        self.listener = HandoffListener(self.endpoint, worker.lock, worker.config.handoff_host,
                                        on_done=lambda tid, state, txn: worker.events.put(("chain_done", (txn, state))),
                                        verifier=worker.verifier, io_timeout_s=io_timeout_for_lease(worker.config.lease_s))
        self.links: dict[str, Link] = {}  # request id -> its incoming link, until published or failed
        self.inner: set[str] = set()  # inner stages here: their first token stays on this worker
        self.num_failed = 0
        self.draining: dict[str, DestinationTransfer] = {}  # aborted admitted stages waiting for quiescence

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    def _on_landed(self, layer: int, blocks: list[int]) -> None:
        with self.landed:
            self.landed.notify_all()

    def _txn(self, link: Link) -> DestinationTransfer:
        return link.txn

    # ---- router messages ----------------------------------------------------------------------
    def on_reserve(self, msg: m.ReserveKv) -> None:
        rid, start = msg.request_id, msg.chain_start
        with self.worker.lock:
            try:
                res = reserve_prefix(self.engine, rid, list(msg.prompt_ids), start, msg.params)
            except InvalidRequest as exc:
                self._reply(msg, False, "no_kv_capacity" if "capacity" in str(exc) else "invalid_request")
                return
            self.blocks.expect(msg.transfer_id, rid, res)
            prefix = msg.prompt_ids[:start]
            request = ReserveRequest(msg.transfer_id, msg.tenant, rid, msg.generation, msg.attempt, msg.source_worker,
                                     msg.source_epoch, prompt_digest(prefix), start, len(res.transfer_block_ids), 0,
                                     reused_block_ids=res.block_ids[: res.num_visible_blocks])
            try:
                reservation = self.endpoint.reserve(request)
            except HandoffError as err:
                self.blocks.drop_expected(msg.transfer_id)
                self._reply(msg, False, err.reason.value)
                return
            self.links[rid] = Link(msg, reservation.reservation_id, self.endpoint.transfers[msg.transfer_id],
                                   time.monotonic())
        self._reply(msg, True, None, res.block_ids, res.num_visible_blocks, reservation.reservation_id)

    def _reply(self, msg: m.ReserveKv, ok: bool, reason: str | None, blocks=(), visible: int = 0, res_id: str = "") -> None:
        self.worker.send(m.Reserved(self.worker.id, self.worker.epoch, msg.request_id, msg.transfer_id, ok, reason,
                                    tuple(blocks), visible, res_id))

    def on_prefill(self, msg: m.Prefill) -> None:
        """A chain stage: stage 0 starts like any prefill; a later one once its prefix lands."""
        stage = msg.chain
        if stage.index + 1 < stage.num_stages:
            self.inner.add(msg.request_id)
        if stage.index == 0:
            self.worker.prefill.on_prefill(msg)
            return
        link = self.links.get(msg.request_id)
        if link is None or link.order.transfer_id != stage.upstream_transfer_id:
            self._fail(msg.request_id, "no reservation for the chain link")
            return
        link.stage = msg
        self.worker.prefill.plans[msg.request_id] = msg  # the onward transfer is the PrefillSide's
        plan = msg.plan
        self.worker.trace.emit("prefill_start", msg.request_id, plan.transfer_id, plan.generation, plan.attempt,
                               worker=self.worker.id, tokens=stage.start)

    # ---- main loop ----------------------------------------------------------------------------
    def poll(self) -> None:
        """Admit stages whose prefix layer 0 landed; fail those whose link broke or never came."""
        with self.worker.lock:
            self._finish_draining()
        now = time.monotonic()
        for rid, link in list(self.links.items()):
            if link.admitted:
                continue
            txn = self._txn(link)
            if link.stage is not None and layer_landed(txn, 0):
                self._admit(rid, link)
            elif (txn is not None and txn.state is TxnState.ABORTED) or link.stalled(txn, now, self.wait_s):
                self._fail(rid, "chain link aborted" if txn is not None and txn.state is TxnState.ABORTED
                           else "chain link never arrived")

    def _admit(self, rid: str, link: Link) -> None:
        msg = link.stage
        with self.worker.lock:
            admit_prefix(self.engine, rid, list(msg.prompt_ids), msg.params, msg.seed)
            self.blocks.committed(link.reservation_id)  # the sequence owns the blocks from now on
            link.admitted = True
        self._close_if_published(rid, link)

    def _close_if_published(self, rid: str, link: Link) -> None:
        """A published link of an admitted stage: close its directory entry (the blocks stay the
        sequence's) and forget it."""
        txn = self._txn(link)
        if not link.admitted or txn is None or txn.state is not TxnState.PUBLISHED:
            return
        with self.worker.lock:
            if self.endpoint.directory.lookup(rid) is not None:
                self.endpoint.admit(rid)
                self.endpoint.retire(rid)
        self.links.pop(rid, None)

    def on_event(self, kind: str, payload) -> None:
        txn, state = payload  # a link's end: its record, which an abort meanwhile may have released
        self._on_link_end(txn, state)
        with self.worker.lock:
            self.endpoint.release(txn.transfer_id)  # a published one stays until its entry is retired

    def _on_link_end(self, txn: DestinationTransfer, state: TxnState) -> None:
        rid = txn.request.request_id
        link = self.links.get(rid)
        if link is None or link.txn is not txn:
            return
        if state is TxnState.PUBLISHED:
            if not link.admitted and link.stage is not None:
                self._admit(rid, link)
            self._close_if_published(rid, link)
            return  # published before its Prefill came: `poll` admits it then
        self._fail(rid, f"chain link {txn.terminal_reason.value if txn.terminal_reason else 'aborted'}")

    # ---- inside the forward -------------------------------------------------------------------
    def wrap(self, hook):
        """The step's layer hook, run after `layer`'s attention: the prefill side's first (it marks
        that layer of onward transfers), then wait until the NEXT layer of every admitted stage's
        prefix has landed (layer 0 landed before admission)."""
        def layer_hook(layer, progress):
            if hook is not None:
                hook(layer, progress)
            for p in progress:
                link = self.links.get(p.request_id)
                if link is not None and link.admitted:
                    self._wait(p.request_id, link, layer + 1)
        return layer_hook

    def _wait(self, rid: str, link: Link, layer: int) -> None:
        """Block until `layer` of the link has landed; ChainBroken if it never will."""
        with self.landed:
            while True:
                txn = self._txn(link)
                if txn is not None and layer_landed(txn, layer):
                    return
                if txn is None or txn.state is TxnState.ABORTED:
                    raise ChainBroken(rid, "chain link aborted during the forward")
                if link.stalled(txn, time.monotonic(), self.wait_s):
                    raise ChainBroken(rid, "chain link stalled")
                self.landed.wait(0.05)

    def on_broken(self, broken: ChainBroken) -> None:
        """The step that needed the prefix was dropped: end the stage."""
        self._fail(broken.request_id, broken.reason)

    def visible(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs the router should see: an inner stage's token is nobody's first token (and
        its only output: the stage is forgotten here)."""
        shown = [o for o in outputs if o.request_id not in self.inner]
        self.inner.difference_update(o.request_id for o in outputs)
        return shown

    # ---- failure and cleanup ------------------------------------------------------------------
    def _fail(self, rid: str, reason: str) -> None:
        log.warning("worker %s: KV-Runahead stage of %s failed: %s", self.worker.id, rid, reason)
        self.num_failed += 1
        self.worker.abort(rid)  # the link's blocks come back once no write into them is in flight
        self.worker.send(m.WorkerError(self.worker.id, self.worker.epoch, rid, reason, FAILED))

    def abort(self, rid: str) -> bool:
        """Called under the worker lock. The link is aborted (fenced at once); an unadmitted
        stage's reservation goes back through the endpoint when the link is quiescent. True when
        the stage was admitted and a write into its blocks is still in flight: the engine must
        keep the sequence (and its blocks) until `poll` sees the link quiescent."""
        self.inner.discard(rid)
        link = self.links.pop(rid, None)
        if link is None:
            return rid in self.draining
        txn = self._txn(link)
        if txn is not None and txn.state < TxnState.PUBLISHED:
            self.endpoint.abort(txn.transfer_id, RejectReason.CANCELLED)
        elif txn is not None and txn.state is TxnState.PUBLISHED and self.endpoint.directory.lookup(rid):
            self.endpoint.retire(rid)
        self.endpoint.release(txn.transfer_id)  # now, or when its link's end is reported
        if link.admitted and not txn.quiescent:
            self.draining[rid] = txn
            return True
        return False

    def _finish_draining(self) -> None:
        """Admitted stages aborted under an in-flight write: their sequence ends once the link is quiet."""
        for rid, txn in list(self.draining.items()):
            if txn.quiescent:
                del self.draining[rid]
                self.worker.finish_abort(rid)

    def holds(self, rid: str) -> bool:
        return rid in self.links

    def close(self) -> None:
        self.listener.close()

    def assert_no_leaks(self) -> None:
        assert not self.links, f"chain links held: {sorted(self.links)}"
        assert not self.draining, f"aborted stages still draining: {sorted(self.draining)}"
        self.endpoint.assert_no_leaks()
        self.blocks.assert_no_leaks()
