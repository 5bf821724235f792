"""A worker process: one engine with a role (prefill, decode or colocated) behind a zmq socket.

Contract: the worker registers with the router, heartbeats its load every `heartbeat_s`, and
handles typed commands between engine steps (see messages.py for the request life cycle).
The main thread owns the engine; handoff threads touch it only under `self.lock`, and the
engine releases the lock during the model forward so transfers land while it computes.
A request that fails here is reported as a WorkerError for that request; the worker keeps
serving. Fault injection never lives here: tests kill the process from outside.
K/V that is not yet safe (a decode reservation before its transfer published, a prefill and its
pinned source copy) is leased (handoff/leases.py): the router renews the leases of its live
requests; a lease nobody renewed for `lease_s` means the request's router is gone, and the
worker aborts the request and reclaims its blocks (counted in `Load.leases_expired`).
The role is not fixed for life: `ChangeRole` drains the worker and switches it to another role
under a new epoch, then it registers again (roles.py; the same process, engine and K/V pool).
A Splitwise loan is not a role change: a `lendable` worker has both sides from the start and
serves whatever phase the router sends it (roles.py).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import sys
import threading
import time
from dataclasses import replace

import zmq

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.errors import EngineError
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.step_log import StepLog
from pdserve.engine.tp_group import TpStartError
from pdserve.engine.kv.vllm_events import VllmEventSink
from pdserve.handoff.trust.capability import verifier_from_hex
from pdserve.handoff.leases import LeaseTable
from pdserve.handoff.trace import TraceSink
from pdserve.model.cpu import summary as cpu_summary
from pdserve.model.numerics import BatchInvarianceError
from pdserve.shm import reap_dead_pools
from pdserve.workers import messages as m
from pdserve.workers.config import WorkerConfig
from pdserve.workers.control_keys import ControlKeys, secure
from pdserve.workers.control_keys import from_env as control_keys_from_env
from pdserve.workers.decode_side import DecodeSide
from pdserve.workers.prefix_fetch.fetch import FetchSide
from pdserve.workers.prefix_fetch.fetch_control import fetch_control_loop, fetch_socket
from pdserve.workers.heartbeat import heartbeat, heartbeat_loop
from pdserve.workers.kv_publisher import KvEventPublisher
from pdserve.workers.local_prefill import LocalPrefills
from pdserve.workers.prefill_side import PrefillSide
from pdserve.workers.runahead_side import ChainBroken, RunaheadSide
from pdserve.workers.roles import RoleSwitch, sides

log = logging.getLogger("pdserve.worker")


def pin_threads(config: WorkerConfig) -> None:
    if config.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(config.cpu_affinity))


class Worker:
    def __init__(self, config: WorkerConfig, control_keys: ControlKeys | None = None):
        pin_threads(config)
        # the router's CURVE keys for this incarnation, never in argv (control_keys.py)
        self.control_keys = control_keys or control_keys_from_env()
        self.config, self.id, self.epoch = config, config.worker_id, config.epoch
        # every pool is shared (pull transfers read it): mode 0600 and an unguessable name (docs/security.md)
        shm = f"pdserve-{config.worker_id}-{os.getpid()}-{secrets.token_hex(16)}"
        reap_dead_pools(config.worker_id)
        self.engine = Engine(_with_shm(config.engine, shm))
        self.kv_events = None  # vLLM-format KV events (workers/kv_publisher.py), when configured
        if config.kv_events_endpoint is not None:
            self.kv_events = KvEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint)
            self.engine.blocks.vllm_events = VllmEventSink(self.engine.abi.block_size)
        self.lock = threading.RLock()
        self.events: queue.Queue = queue.Queue()  # from handoff threads to the main loop
        self.trace = TraceSink(path=config.trace_path, keep=False)
        self.engine.step_log = StepLog(config.step_log_path) if config.step_log_path else None
        self.roles = RoleSwitch(config.role, config.epoch)  # role changes (roles.py)
        # one verifier for both sides (and the sides of later roles); the router's key moves it on
        self.verifier = verifier_from_hex(config.capability_key, config.capability_key_epoch)
        self.prefill, self.decode, self.fetch = None, None, None
        self._build_sides()
        self.engine.external_tables = lambda: self.fetch.tables()  # blocks a prefix fetch pins (fetch.py)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, config.worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        secure(self.sock, self.control_keys)
        self.sock.connect(config.router_address)
        self.running = True
        self._fetch_thread: threading.Thread | None = None  # fetch messages off the step thread (fetch_control.py)
        self.applied_grant_seq = 0
        self._last_integrity = True  # the pool check's last verdict (heartbeat.integrity_ok)
        self.leases = LeaseTable(config.lease_s)
        self.leases_reclaimed = 0
        self._next_lease_check = 0.0
        self.kv_resync_wanted = True  # the first heartbeat of an epoch carries the whole prefix key set
        self.loop_at, self.last_load = time.monotonic(), None  # the main loop's last turn; the last beat's load

    # ---- messaging ------------------------------------------------------------------------
    def send(self, msg: m.ToRouter) -> None:
        for body in m.bounded(msg):  # one body, unless a Tokens batch is over the router's bound
            self.sock.send(body)

    def register(self) -> None:
        with self.lock:
            self.kv_resync_wanted = True  # a new epoch starts with an empty index entry at the router
        eng, kernels = self.engine, self.engine.numerics.get("kernel_threads")  # None on a GPU
        print(f"pdserve worker {self.id} (epoch {self.epoch}, {self.role}): {cpu_summary()}; "
              f"compute {eng.numerics['compute_dtype']}, products {eng.numerics['products']}"
              f"{'' if kernels is None else f'; C kernel threads {kernels}'}", file=sys.stderr, flush=True)
        self.send(m.Register(
            worker_id=self.id, epoch=self.epoch, host_id=self.config.host_id, role=self.role, pid=os.getpid(),
            num_blocks=eng.pool.num_blocks, block_size=eng.abi.block_size, model_hash=eng.identity.model_hash,
            abi_hash=eng.abi.abi_hash, bytes_per_token=eng.abi.bytes_per_token, max_model_len=eng.max_model_len,
            prefix_identity=eng.identity.identity_hash, cpu=eng.numerics,
            handoff_address=self.decode.address if self.decode else (self.runahead.address if self.runahead else None), shm_name=eng.pool.shm_name,
            fetch_address=self.fetch.address, tp=eng.config.tp,
            host_shm_name=eng.blocks.host.shm_name if eng.blocks.host is not None else None,
        ))

    def heartbeat(self) -> m.Heartbeat:
        return heartbeat(self)  # heartbeat.py

    # ---- main loop ------------------------------------------------------------------------
    def run(self) -> None:
        fetch_sock = fetch_socket(self)  # connected before the router learns of this worker
        self._fetch_thread = threading.Thread(target=fetch_control_loop, args=(self, fetch_sock), daemon=True,
                                              name="fetch-control")
        self._fetch_thread.start()
        self.register()
        threading.Thread(target=heartbeat_loop, args=(self,), daemon=True, name="heartbeat").start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while self.running:
            self.loop_at = time.monotonic()  # heartbeats stop when this stands still (heartbeat.py)
            busy = self.engine.has_unfinished()
            timeout_ms = 0 if busy else 2
            while dict(poller.poll(timeout_ms)).get(self.sock):
                self.handle(m.decode_to_worker(self.sock.recv()))
                timeout_ms = 0
            self.drain_events()
            if self.runahead is not None:
                self.runahead.poll()  # admit chain stages whose prefix began to land
            self.expire_leases()
            self.fetch.tick()
            if self.roles.draining and self._quiet():
                self._switch_role()
            if self.engine.has_unfinished():
                self.step()
            if self.kv_events is not None:
                self.kv_events.publish(self.engine.blocks.vllm_events)
        self.close()

    def handle(self, msg: m.ToWorker) -> None:
        self.applied_grant_seq = max(self.applied_grant_seq, getattr(msg, "grant_seq", 0))
        try:
            if isinstance(msg, m.Generate):
                self.add_local(msg)
            elif isinstance(msg, m.Prefill):
                self.leases.grant(msg.request_id, time.monotonic())
                (self.runahead if msg.chain is not None else self.prefill).on_prefill(msg)
            elif isinstance(msg, m.ReserveKv):
                self.leases.grant(msg.request_id, time.monotonic())
                (self.runahead if msg.chain_start else self.decode).on_reserve(msg)
            elif isinstance(msg, m.RenewLeases):
                with self.lock:  # the fetch leases are the fetch thread's too (fetch.py)
                    self.leases.renew(msg.request_ids, time.monotonic())
                    self.fetch.leases.renew(msg.request_ids, time.monotonic())
            elif isinstance(msg, m.StartDecode):
                self.decode.on_start(msg)
            elif isinstance(msg, m.Abort):
                self.abort(msg.request_id)
            elif isinstance(msg, m.ChangeRole):
                self.change_role(msg)
            elif isinstance(msg, m.CapabilityKey):
                if self.verifier is not None and msg.key_epoch > self.verifier.key_epoch:
                    self.verifier.install(bytes.fromhex(msg.public_key_hex), msg.key_epoch)
            elif isinstance(msg, m.RouteEpoch):
                if self.verifier is not None:
                    self.verifier.advance_route(msg.route_epoch)
            elif isinstance(msg, m.ResyncKv):
                with self.lock:
                    self.kv_resync_wanted = True  # answered by the next heartbeat
            elif isinstance(msg, (m.FetchReserve, m.FetchPin, m.FetchServe, m.FetchAbort)):
                self.fetch.receive(msg)  # the router reached this worker here, not on its fetch socket (fetch_control.py)
            elif isinstance(msg, m.Shutdown):
                self.running = False
        except (EngineError, ValueError, KeyError) as exc:
            log.warning("worker %s: %s failed: %r", self.id, type(msg).__name__, exc)
            self.send(m.WorkerError(self.id, self.epoch, getattr(msg, "request_id", "?"), str(exc), "invalid_request"))
        self.acknowledge(msg)

    def acknowledge(self, msg: m.ToWorker) -> None:
        """Tell the router a control message took effect (its rollback waits for these)."""
        v = self.verifier
        if isinstance(msg, m.RouteEpoch):
            ack = ("route_epoch", str(v.route_epoch if v is not None else msg.route_epoch))
        elif isinstance(msg, m.CapabilityKey):
            ack = ("capability_key", str(v.key_epoch if v is not None else msg.key_epoch))
        elif isinstance(msg, m.Abort) and msg.ack:
            ack = ("abort", msg.request_id)
        else:
            return
        self.send(m.ControlAck(self.id, self.epoch, *ack, time.time()))

    def add_local(self, msg: m.Generate) -> None:
        """A whole request here: colocated serving, or a local prefill on a decode worker."""
        with self.lock:
            self.local_prefills.accept(msg.request_id)
            self.engine.add_request(msg.request_id, list(msg.prompt_ids), msg.params, seed=msg.seed,
                                    resume_output_ids=msg.resume_output_ids)

    @property
    def role(self) -> str:
        return self.roles.role

    def _build_sides(self) -> None:
        """The sides the current role needs, under the current epoch (at start and after a switch)."""
        has_prefill, has_decode = sides(self.role, self.config.lendable)
        self.prefill = PrefillSide(self) if has_prefill else None
        self.decode = DecodeSide(self) if has_decode else None
        self.runahead = RunaheadSide(self) if has_prefill and not has_decode else None  # KV-Runahead stages
        self.local_prefills = LocalPrefills(self.role, self.config.lendable)  # Generate on a decode worker (local_prefill.py)
        self.fetch = FetchSide(self)  # cross-worker prefix fetch, both ends, in every role (fetch.py)

    def change_role(self, msg: m.ChangeRole) -> None:
        """Begin a role change (roles.py): what the router could not drain is aborted now (the
        router recovers it when the new epoch registers); the switch waits until no handoff
        thread still touches this worker's blocks."""
        self.roles.request(msg.role, msg.epoch)
        log.warning("worker %s: role change %s -> %s (epoch %d -> %d)", self.id, self.role, msg.role, self.epoch, msg.epoch)
        for rid in self._held_requests():
            self.abort(rid)

    def _held_requests(self) -> list[str]:
        held = set(self.engine.seqs) | set(self.engine.imports)
        if self.decode is not None:
            held |= set(self.decode.requests) | self.decode.decoding
        if self.prefill is not None:
            held |= set(self.prefill.plans)
        if self.runahead is not None:
            held |= set(self.runahead.links)  # chain stages whose prefix is still landing
        return sorted(held)

    def _quiet(self) -> bool:
        """Nothing runs here and no transfer thread still reads or writes this worker's blocks."""
        with self.lock:
            if self.engine.has_unfinished() or self.engine.imports or self.fetch.busy:
                return False
            if self.prefill is not None and (self.prefill.started or self.prefill.plans or self.engine.prefilled):
                return False
            if self.runahead is not None and (self.runahead.links or self.runahead.draining):
                return False
            return self.decode is None or (not self.decode.requests and not self.decode.decoding)

    def _switch_role(self) -> None:
        """Take the target role under the new epoch and register again (the router's registry
        retires the old epoch: every later message of it is dropped)."""
        with self.lock:
            if self.decode is not None:
                self.decode.close()
            if self.runahead is not None:
                self.runahead.close()
            self.fetch.close()
            old, new = self.roles.finish()
            self.epoch = self.roles.epoch
            self._build_sides()
            self.applied_grant_seq = 0  # the router restarts a new epoch's grant sequence (reservations.py)
        self.leases = LeaseTable(self.config.lease_s)
        self.register()
        log.warning("worker %s: now %s under epoch %d (was %s)", self.id, new, self.epoch, old)

    def expire_leases(self) -> None:
        """Reclaim the K/V of requests whose router stopped renewing their leases (every 0.2 s)."""
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + 0.2
        for rid in self.leases.expired(now):
            if (self.decode is not None and self.decode.holds(rid)) or (self.prefill is not None and self.prefill.holds(rid)):
                log.warning("worker %s: lease of %s expired unrenewed, reclaiming its K/V", self.id, rid)
                self.abort(rid)
                self.leases_reclaimed += 1

    def abort(self, request_id: str) -> None:
        """Every abort trigger ends here (the router's Abort on a client disconnect, reroute or
        recompute, an expired lease, a role change, a failed chain stage). One release path per
        block: a destination's blocks go back through its endpoint once no granted write is open
        (the engine's abort never frees an import), an admitted chain stage under a write waits
        for `finish_abort`, and a source copy stays pinned while its transfer still runs."""
        self.leases.drop(request_id)
        with self.lock:
            if self.decode:
                self.decode.abort(request_id)
            if self.prefill is not None:
                self.prefill.abort(request_id)  # no transfer starts for it any more; a running one is cancelled
            if self.runahead and self.runahead.abort(request_id):
                return  # RunaheadSide.poll calls finish_abort once the link is quiescent
            self.finish_abort(request_id)

    def finish_abort(self, request_id: str) -> None:
        """The engine's part of an abort (under the lock): the sequence stops; a source copy an
        outgoing transfer still reads stays pinned until that transfer's end releases it."""
        with self.lock:
            transfer_running = self.prefill is not None and request_id in self.prefill.started
            self.engine.abort(request_id, keep_blocks=transfer_running)

    def drain_events(self) -> None:
        while True:
            try:
                kind, payload = self.events.get_nowait()
            except queue.Empty:
                return
            side = self.fetch if kind.startswith("fetch") else self.prefill if kind.startswith("source") else self.decode
            side = self.runahead if kind.startswith("chain") else side
            side.on_event(kind, payload)

    def step(self) -> None:
        hook = self.prefill.layer_hook if self.prefill else None
        hook = self.runahead.wrap(hook) if self.runahead else hook
        try:
            outputs = self.engine.step(layer_hook=hook, lock=self.lock)
        except ChainBroken as broken:  # the step's results are dropped; the others run again
            self.runahead.on_broken(broken)
            return
        if self.prefill:
            self.prefill.after_step(outputs)
        if self.decode:
            self.decode.after_step(outputs)
        self.send_outputs(self.runahead.visible(outputs) if self.runahead else outputs)

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        holds = self.decode.hold_watch.counts if self.decode is not None else lambda rid: (0, 0)
        items = tuple(
            m.TokenItem(o.request_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.num_prompt_tokens,
                        o.num_cached_tokens, o.prefilled, o.index, o.logprobs, o.prompt_logprobs, o.forks,
                        *holds(o.request_id))
            for o in outputs
        )
        self.send(m.Tokens(self.id, self.epoch, items))

    def close(self) -> None:
        if self._fetch_thread is not None:  # it ends within a poll once `running` is False
            self.running = False
            self._fetch_thread.join(timeout=1.0)
        if self.decode:
            self.decode.close()
        if self.runahead:
            self.runahead.close()
        self.fetch.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.sock.close()
        self.trace.close()
        if self.engine.step_log is not None:
            self.engine.step_log.close()
        self.engine.close()  # tensor-parallel followers stop (engine/tp_group.py)
        self.engine.pool.close(unlink=True)
        if self.engine.blocks.host is not None:
            self.engine.blocks.host.close()  # its shared segment too


def _with_shm(config: EngineConfig, shm_name: str | None) -> EngineConfig:
    return replace(config, kv_shm_name=shm_name)


def serve_worker(config: WorkerConfig, control_keys: ControlKeys | None = None) -> None:
    """Process entry point (multiprocessing target or Ray actor body). A machine that cannot keep
    rows batch-invariant ends the worker with one clear line instead of serving inexactly; so does
    a tensor-parallel rank lost during the start (exit 1: a restart may come up)."""
    try:
        worker = Worker(config, control_keys)
    except BatchInvarianceError as exc:
        print(f"pdserve worker {config.worker_id}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except TpStartError as exc:
        print(f"pdserve worker {config.worker_id}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    try:
        worker.run()
    finally:
        if worker.running:
            worker.close()
