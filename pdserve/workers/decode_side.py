"""The decode role inside a worker: reserve, receive and publish handed-off K/V, then decode.

Life cycle of one request here:
    ReserveKv -> engine.reserve_import (prefix hits + fresh blocks + growth capacity) and the
        endpoint's reservation -> Reserved(ok, blocks, reservation id) to the router
    handoff link (listener thread) -> chunks land, validate, one atomic publish
    StartDecode(first token, seed) and PUBLISHED, in either order -> endpoint.admit (only a
        PUBLISHED handle is admitted) -> engine.commit_import: decoding starts (n > 1: the
        sequences StartDecode names fork over the one imported prompt, engine/fork.py)
    finish or abort -> endpoint.retire; an unpublished transfer aborts through the endpoint,
        which returns every reserved block (the adapter cancels the engine reservation).
    the transfer's record leaves the endpoint once it is finished and nothing reads it (`release`
        on abort and at its link's report, `retire` for a published one).
"""

from __future__ import annotations

from pdserve.handoff.destination import ReserveRequest
from pdserve.handoff.endpoint import DecodeEndpoint
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.limits import io_timeout_for_lease
from pdserve.handoff.states import TxnState
from pdserve.engine.outputs import RequestOutput
from pdserve.workers import messages as m
from pdserve.workers.handoff_io import HandoffListener, prompt_digest
from pdserve.workers.hold_watch import HoldWatch, hold_params
from pdserve.workers.kv_blocks import EngineDestinationBlocks


class DecodeSide:
    def __init__(self, worker):
        self.worker = worker
        self.engine = worker.engine
        self.blocks = EngineDestinationBlocks(self.engine)
        self.endpoint = DecodeEndpoint(worker.id, worker.epoch, self.engine.pool, self.blocks, self.engine.identity,
                                       trace=worker.trace)
        self.listener = HandoffListener(self.endpoint, worker.lock, worker.config.handoff_host,
                                        on_done=lambda tid, state, txn: worker.events.put(("dest_done", (txn, state))),
                                        verifier=worker.verifier, io_timeout_s=io_timeout_for_lease(worker.config.lease_s))
        self.requests: dict[str, m.ReserveKv] = {}  # request id -> its reservation order
        self.first: dict[str, m.StartDecode] = {}
        self.published: set[str] = set()
        self.decoding: set[str] = set()
        self.hold_watch = HoldWatch()  # --reserve dynamic: growths and preemptions past each hold (hold_watch.py)

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    def on_reserve(self, msg: m.ReserveKv) -> None:
        eng, rid = self.engine, msg.request_id
        with self.worker.lock:
            params = hold_params(msg.params, msg.reserve_tokens)  # the predicted bound (reserve dynamic) or max_tokens
            if not eng.can_reserve_import(len(msg.prompt_ids), params.max_tokens, params.n):
                self.worker.send(m.Reserved(self.worker.id, self.worker.epoch, rid, msg.transfer_id, False, "no_kv_capacity"))
                return
            res = eng.reserve_import(rid, list(msg.prompt_ids), params)
            self.blocks.expect(msg.transfer_id, rid, res)
            request = ReserveRequest(
                msg.transfer_id, msg.tenant, rid, msg.generation, msg.attempt, msg.source_worker, msg.source_epoch,
                prompt_digest(msg.prompt_ids), len(msg.prompt_ids), len(res.transfer_block_ids), 0,
                reused_block_ids=res.block_ids[: res.num_visible_blocks],
            )
            try:
                reservation = self.endpoint.reserve(request)
            except HandoffError as err:
                self.blocks.drop_expected(msg.transfer_id)
                self.worker.send(m.Reserved(self.worker.id, self.worker.epoch, rid, msg.transfer_id, False, err.reason.value))
                return
        self.requests[rid] = msg
        if params is not msg.params:
            self.hold_watch.watch(rid, len(res.block_ids) + res.growth_blocks)
        self.worker.send(m.Reserved(self.worker.id, self.worker.epoch, rid, msg.transfer_id, True, None,
                                    res.block_ids, res.num_visible_blocks, reservation.reservation_id))

    def holds(self, rid: str) -> bool:
        """Blocks are reserved for `rid` and decode has not taken them over yet."""
        return rid in self.requests

    def on_start(self, msg: m.StartDecode) -> None:
        self.first[msg.request_id] = msg
        self._try_commit(msg.request_id)

    def on_event(self, kind: str, payload) -> None:
        txn, state = payload  # a link's end: its record, which an abort meanwhile may have released
        transfer_id, rid = txn.transfer_id, txn.request.request_id
        published = state is TxnState.PUBLISHED
        reason = None if published else (txn.terminal_reason.value if txn.terminal_reason else "aborted")
        self.worker.send(m.TransferDone(self.worker.id, self.worker.epoch, rid, transfer_id, txn.request.generation,
                                        "destination", published, reason))
        if published and rid in self.requests:
            self.published.add(rid)
            self._try_commit(rid)
        elif not published and self._ordered(rid, transfer_id):
            self._forget(rid)
        with self.worker.lock:
            self.endpoint.release(transfer_id)  # a published one stays until decode retires it

    def _try_commit(self, rid: str) -> None:
        if rid not in self.published or rid not in self.first or rid not in self.requests:
            return
        order, start = self.requests.pop(rid), self.first.pop(rid)
        self.published.discard(rid)
        with self.worker.lock:
            handle = self.endpoint.admit(rid)  # only a PUBLISHED handle is admitted
            self.engine.commit_import(rid, list(order.prompt_ids), start.first_token, order.params, start.seed,
                                      start.forks)
            self.blocks.committed(handle.reservation_id)
        self.decoding.add(rid)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        if len(self.hold_watch):
            with self.worker.lock:
                self.hold_watch.after_step(self.engine, [o.request_id for o in outputs if o.finished])
        for out in outputs:
            if out.finished and out.request_id in self.decoding:
                self.decoding.discard(out.request_id)
                with self.worker.lock:
                    self.endpoint.retire(out.request_id)

    def abort(self, rid: str) -> None:
        """Called under the worker lock. Returns the request's blocks whatever its stage."""
        self.hold_watch.forget(rid)
        if rid in self.decoding:
            self.decoding.discard(rid)
            self.endpoint.retire(rid)
            return
        order = self.requests.get(rid)
        if order is None:
            return
        txn = self.endpoint.transfers.get(order.transfer_id)
        if txn is not None and txn.state is TxnState.PUBLISHED:
            self.endpoint.retire(rid)
        elif txn is not None and txn.state is not TxnState.ABORTED:
            self.endpoint.abort(order.transfer_id, RejectReason.CANCELLED)
        self.endpoint.release(order.transfer_id)  # now, or when its link's end is reported
        self._forget(rid)

    def _ordered(self, rid: str, transfer_id: str) -> bool:
        """`transfer_id` is the request's current reservation here (or it has none): a rerouted
        request's older link ending must not forget the newer reservation."""
        order = self.requests.get(rid)
        return order is None or order.transfer_id == transfer_id

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.first.pop(rid, None)
        self.published.discard(rid)

    def close(self) -> None:
        self.listener.close()
