"""The prefill role inside a worker: prefill-only requests whose K/V is handed to a decode worker.

Life cycle of one request here:
    Prefill(plan) -> engine.add_request(PREFILL_ONLY)
    -> (layer-wise) the step that completes the prompt starts the transfer at layer 0 and marks
       each layer ready as the forward passes it; (serialized) the transfer starts after the step
    -> first token reported to the router (prefilled=True)
    -> source transfer PUBLISHED: the source copy is released (publication was acknowledged)
       ABORTED: released too; the router recomputes or reroutes (decode-start fallback)
    -> TransferDone(side="source") with logical and physical bytes, chunk resends, transfer and
       exposed seconds.
    abort while the transfer runs -> the transfer is cancelled (the destination gets an AbortFrame)
       and the blocks stay pinned until its thread ended and the destination hung up.
"""

from __future__ import annotations

import logging
import time

from pdserve.engine.outputs import PrefillProgress, RequestOutput
from pdserve.engine.sequence import SeqMode
from pdserve.handoff.limits import io_timeout_for_lease
from pdserve.handoff.source import SourceTransfer
from pdserve.handoff.states import TxnState
from pdserve.handoff.streaming import ScheduleConfig, choose_schedule
from pdserve.workers import messages as m
from pdserve.workers.handoff_io import HandoffSender, transfer_blocks

log = logging.getLogger("pdserve.worker")


class PrefillSide:
    def __init__(self, worker):
        self.worker = worker
        self.engine = worker.engine
        self.sender = HandoffSender(worker.id, worker.epoch, self.engine.pool, self.engine.identity, worker.trace,
                                    on_done=lambda rid, src, dt, phys: worker.events.put(("source_done", (rid, src, dt, phys, time.monotonic()))),
                                    prefill_chunk_tokens=self.engine.config.max_num_batched_tokens,
                                    verifier=worker.verifier, io_timeout_s=io_timeout_for_lease(worker.config.lease_s))
        self.plans: dict[str, m.Prefill] = {}
        self.started: dict[str, SourceTransfer] = {}
        self.prefill_end: dict[str, float] = {}

    def on_prefill(self, msg: m.Prefill) -> None:
        with self.worker.lock:
            self.engine.add_request(msg.request_id, list(msg.prompt_ids), msg.params, mode=SeqMode.PREFILL_ONLY, seed=msg.seed)
        self.plans[msg.request_id] = msg
        plan = msg.plan
        self.worker.trace.emit("prefill_start", msg.request_id, plan.transfer_id, plan.generation, plan.attempt, worker=self.worker.id)

    def _schedule(self, msg: m.Prefill) -> str:
        if msg.chain is not None and msg.chain.index + 1 < msg.chain.num_stages:
            return "layerwise"  # a KV-Runahead link: the next stage computes each layer as it lands
        return choose_schedule(len(msg.prompt_ids), ScheduleConfig(self.worker.config.layerwise_threshold_tokens))

    def _start(self, request_id: str, schedule: str) -> SourceTransfer:
        msg = self.plans[request_id]
        blocks = self.engine.kv_blocks(request_id)
        src = self.sender.start(request_id, msg.prompt_ids, blocks, msg.plan, msg.plan.tenant, schedule)
        self.started[request_id] = src
        return src

    def layer_hook(self, layer: int, progress: tuple[PrefillProgress, ...]) -> None:
        """Runs inside the forward, after `layer` wrote its K/V rows: the producer gate advances.
        A long prompt's transfer starts with its first prefill chunk, so the K/V of finished
        chunks stream while later chunks compute; only the last chunk's share is left to send
        after the prompt completes."""
        for p in progress:
            msg = self.plans.get(p.request_id)
            if msg is None or self._schedule(msg) != "layerwise" or msg.params.max_tokens <= 1:
                continue
            if p.request_id not in self.started:
                self._start(p.request_id, "layerwise")
            gate = self.sender.gate(p.request_id)
            if gate is None:  # the transfer already ended (aborted): nothing waits for this layer
                continue
            if layer == 0:  # the blocks this step writes were allocated when it was scheduled
                self.started[p.request_id].set_src_blocks(transfer_blocks(self.engine.kv_blocks(p.request_id), msg.plan))
            if p.completes:
                gate.mark_ready(layer)
            else:
                gate.mark_progress(layer, p.computed_tokens)
            plan = msg.plan
            self.worker.trace.emit("layer_ready", p.request_id, plan.transfer_id, plan.generation, plan.attempt,
                                   layer=layer, worker=self.worker.id, tokens=None if p.completes else p.computed_tokens)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            msg = self.plans.get(out.request_id)
            if msg is None or out.index != 0:  # n > 1: sequence 0's output says whether the request goes on
                continue
            plan = msg.plan
            self.prefill_end[out.request_id] = time.monotonic()
            self.worker.trace.emit("prefill_end", out.request_id, plan.transfer_id, plan.generation, plan.attempt, worker=self.worker.id)
            if out.finished:  # ended at the first token: nothing to hand off (the router drops D's reservation)
                self.plans.pop(out.request_id)
                continue
            if out.request_id not in self.started:
                with self.worker.lock:
                    self._start(out.request_id, "serialized")
                gate = self.sender.gate(out.request_id)
                if gate is not None:
                    gate.mark_all_ready()

    def on_event(self, kind: str, payload) -> None:
        rid, src, transfer_s, physical, done_at = payload
        published = src.state is TxnState.PUBLISHED
        if not published:
            log.warning("transfer %s aborted at the source: %s", src.manifest.transfer_id, src.terminal_reason)
        with self.worker.lock:
            if published:
                src.release_source()  # legal only after the publish ack; the engine frees the blocks
            if rid in self.engine.prefilled:
                self.engine.release_prefilled(rid)
        self.started.pop(rid, None)
        self.plans.pop(rid, None)
        end = self.prefill_end.pop(rid, done_at)
        manifest = src.manifest
        self.worker.send(m.TransferDone(
            self.worker.id, self.worker.epoch, rid, manifest.transfer_id, manifest.fence.generation, "source", published,
            reason=None if published else (src.terminal_reason.value if src.terminal_reason else "aborted"),
            logical_bytes=manifest.total_bytes, physical_bytes=physical,
            transfer_s=transfer_s, exposed_s=max(0.0, done_at - end), resends=src.log.num_resends,
            dest_worker=manifest.fence.destination_worker, serialized=manifest.schedule == "serialized",
        ))

    def holds(self, request_id: str) -> bool:
        """The request is prefilling, or its source copy is kept for (or pinned by) a handoff."""
        return request_id in self.plans or request_id in self.started or request_id in self.engine.prefilled

    def abort(self, request_id: str) -> bool:
        """Forget the request; True when its transfer is still running: the transfer is told to
        abort and the engine must keep the source blocks until `on_event` releases them."""
        self.plans.pop(request_id, None)
        self.prefill_end.pop(request_id, None)
        return request_id in self.started and self.sender.cancel(request_id)
