"""The router process's serving backend: the control plane wired to worker processes over zmq.

Contract: implements the API's `Backend`. One asyncio task receives every worker message and
applies it, only from keys this router issued and only as the worker its key names
(control_auth.py): anything else is dropped and counted, never the end of the task, and a router
task that ends before `close` makes `healthy()` false. `submit` drives one request through its
life cycle (messages.py):
    route (early rejection -> Rejection, no prefill work spent)
    disaggregated: ReserveKv at D (reservation before prefill) -> Prefill at P with the plan
        (both sent by frontend_start.py) -> first token from P (TTFT) -> StartDecode at D
        -> tokens from D -> finish
    colocated, or a local prefill (the router's P/D decision, router/policy/pd_decision.py):
        Generate at W (the decode worker) -> tokens -> finish
Failures: a dead or retired worker, or a transfer that cannot publish, takes the decode-start
fallback chain (router/process/recovery.py: wait, reroute, recompute with the same seed, or an explicit
`kv_not_visible` error); nothing hangs and nothing is cut off silently. A worker lost while a
request is still in admission (no worker owns it yet) sends it back through admission
(`RouteLost`) instead; a request with no complete route only because a dead worker is being
started again waits in admission (`admission_waits`). Messages from a retired epoch or from a worker
that no longer owns a request are dropped. Every hold the router took is released exactly
once (complete or abort).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.engine.kv.block_manager import DEFAULT_TENANT, prompt_block_hashes, root_hash
from pdserve.engine.errors import InvalidRequest
from pdserve.router.contract import ErrorEvent, FinishEvent, GenerationRequest, WorkerView
from pdserve.router.errors import UnknownRequestError
from pdserve.router.kv.fetch_runner import FetchRunner
from pdserve.router.kv.kv_inbox import KvInbox
from pdserve.router.kv.kv_index import hash_key
from pdserve.router.messages import Role, WorkerInfo
from pdserve.router.pricing.decode_clocks import ItlWindows
from pdserve.router.process import frontend_admission as admission
from pdserve.router.process import frontend_events as ev
from pdserve.router.process import frontend_upkeep as upkeep
from pdserve.router.process import recovery
from pdserve.router.process.capabilities import CapabilityIssuer
from pdserve.router.process.control_acks import ControlAcks
from pdserve.router.process.control_auth import ControlAuth
from pdserve.router.process.control_handshakes import MONITOR_EVENTS, HandshakeTally
from pdserve.router.process.inflight import InFlight, RequestTraceWriter
from pdserve.router.process.metrics import RuntimeMetrics
from pdserve.router.process.output_collector import OutputCollector
from pdserve.router.process.serving_metrics import register_serving_metrics
from pdserve.router.router import Router
from pdserve.router.tetri.tetri_runtime import TetriRuntime
from pdserve.workers import messages as m

log = logging.getLogger("pdserve.router")


class ClusterBackend:
    def __init__(self, router: Router, model_name: str, tokenizer, max_model_len: int, bind: str, vocab_size: int = 0,
                 trace_path: str | None = None, is_dead: Callable[[], list[str]] = lambda: [], transport: str = "auto",
                 admission_wait_s: float = 30.0, lease_renew_s: float = 10.0, restarts: bool = False,
                 kv_sharing: bool = True):
        self.router, self.model_name, self._tokenizer = router, model_name, tokenizer
        self.lease_renew_s = lease_renew_s  # well inside the workers' lease (ServeConfig.lease_s / 3)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = RuntimeMetrics(lambda: router.counters().route_total, lambda: [w.role for w in self.registered.values()],
                                      lambda: self.trace.clock_samples(), (router.config.ttft_slo_s, router.config.tpot_slo_s),
                                      lambda: router.counters().pd_decisions, router.kv_index_stats)
        self.trace = RequestTraceWriter(trace_path)
        # prefix hits kept by the router, tier gauges, request clocks, and vLLM's names for them (serving_metrics.py)
        self.hits, self.clocks = register_serving_metrics(self.metrics.registry, model_name, lambda: self.loads,
                                                          lambda: self.live.values())
        self.ctx = zmq.asyncio.Context.instance()
        self.control_auth = ControlAuth(lambda reason: self.metrics.control_rejects.labels(reason).inc())  # control_auth.py
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.control_auth.secure(self.sock)
        self._monitor = self.sock.get_monitor_socket(MONITOR_EVENTS)  # failed handshakes, counted
        self.handshakes = HandshakeTally(self.sock.getsockopt(zmq.HANDSHAKE_IVL) / 1000)  # control_handshakes.py
        self.sock.bind(bind)
        self.failed: str | None = None  # a router task that ended before close: /health says unhealthy
        self._closing = False
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.is_dead = is_dead
        self.transport = transport
        self.admission_wait_s = admission_wait_s
        self.restarts = restarts  # the launcher starts dead workers again (workers/process/supervisor.py)
        self.stopping = False  # the server got its stop signal (`stop_serving`)
        self.away: set[str] = set()  # workers lost and not routable again yet (registered and reported load)
        self.admission_line = admission.AdmissionLine()  # requests waiting in admission, first come first served
        self.registered: dict[str, m.Register] = {}
        self.origin_roles: dict[str, str] = {}  # the role each worker was launched in
        self.on_role_changed: Callable[[str, str, int], None] = lambda wid, role, epoch: None  # the launcher's
        self.on_key_rotated: Callable[[str, int], None] = lambda key, epoch: None  # the launcher's
        # supervision (api/server.py's launcher): a registration counts as healthy, a hung worker is ended,
        # FAILED workers (past the crash-loop limit) stay in /workers; a request moves at most max_reroutes times
        self.on_worker_registered: Callable[[str, int], None] = lambda wid, epoch: None
        self.on_worker_hung: Callable[[str, int, str], None] = lambda wid, epoch, reason: None
        self.failed_workers: Callable[[], list[str]] = lambda: []
        self.max_reroutes = 2
        self.last_register: dict[str, m.Register] = {}  # each worker's latest registration (a FAILED one's row)
        self.loads: dict[str, m.Load] = {}
        self.live: dict[str, InFlight] = {}
        self.engine_ids: dict[str, str] = {}  # engine request id of a retried attempt -> request id
        self._grant_seq: dict[str, int] = {}
        self._prefix_identity: str | None = None  # the workers' cache identity: the chain roots' base
        self._block_size = 16
        self._tasks: list[asyncio.Task] = []
        self._gen = itertools.count(1)
        self.runahead = None  # KV-Runahead chains (router/runahead/runahead.py), set by the server with --prefill-runahead
        # signs every transfer under the current route epoch; workers hold its public key (launch config)
        self.capabilities = CapabilityIssuer(route_epoch=lambda: router.route_epoch)
        self.tetri = TetriRuntime(self)  # --reserve static|dynamic, predictions (tetri_runtime.py); serve sets its policy
        self.fetches = FetchRunner(self, kv_sharing)  # cross-worker prefix fetch before a prefill (fetch_runner.py)
        self.acks = ControlAcks()  # acknowledgements the rollback waits for (control_acks.py)
        self.kv_inbox = KvInbox()  # heartbeats' block events, applied off the routing path (frontend_upkeep.apply_kv_slice)
        self.itl = ItlWindows()  # decode workers' recent inter-token gaps: the P/D decision's p90 ITL (decode_clocks.py)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.control_auth.start(self.ctx)
        self._tasks = [loop.create_task(self._receive_loop(), name="receive"), loop.create_task(self._watchdog(), name="watchdog"),
                       loop.create_task(self._monitor_loop(), name="control-monitor")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        """A router task must live as long as the backend: one that ends before `close` (an error,
        or cancelled by anything else) marks it unhealthy."""
        if self._closing:
            return
        error = None if task.cancelled() else task.exception()
        self.failed = f"{task.get_name()}: {'cancelled' if task.cancelled() else repr(error)}"
        self.metrics.loop_failures.labels(task.get_name()).inc()
        log.error("router task ended: %s", self.failed, exc_info=error)

    async def wait_for_workers(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # ready = registered and reported load once (the registry makes a worker routable then)
        while len(self.registered) < count or any(wid not in self.loads for wid in self.registered):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.registered)} of {count} workers registered in {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self._closing = True
        for wid in list(self.registered):
            await self._send(wid, m.Shutdown())
        for task in self._tasks:
            task.cancel()
        self.control_auth.stop()
        if not self.sock.closed:
            self.sock.disable_monitor()
        self._monitor.close()
        self.sock.close()
        self.trace.close()

    def stop_serving(self) -> None:
        """The server got its stop signal: nothing is admitted from now on (a request waiting in
        admission is refused, 503 `shutdown`) and every started request ends now with
        ErrorEvent("shutdown"), its workers told to abort, so that open streams end at once rather
        than when their generation would have (the HTTP server waits for them before it stops)."""
        self.stopping = True
        asyncio.get_running_loop().create_task(self._end_started())

    async def _end_started(self) -> None:
        for live in list(self.live.values()):
            if live.owners and not live.done:
                await recovery.fail(self, live, "the server is stopping", "shutdown")

    def lookup(self, engine_id: str) -> InFlight | None:
        """The in-flight request a worker message names, if that attempt is still the current one."""
        live = self.live.get(self.engine_ids.get(engine_id, engine_id))
        return live if live is not None and live.engine_id == engine_id else None

    def alias(self, live: InFlight, engine_id: str) -> str:
        self.engine_ids[engine_id] = live.req.request_id
        return engine_id

    def release(self, request_id: str, completed: bool) -> None:
        """Release the router's holds for a request once; a route already released (its worker
        was retired and the holds orphaned) is not an error here."""
        try:
            (self.router.complete if completed else self.router.abort)(request_id)
        except UnknownRequestError:
            pass

    # ---- Backend protocol -----------------------------------------------------------------
    def tokenizer(self):
        return self._tokenizer

    def healthy(self) -> bool:
        if self.failed is not None:
            return False
        roles = {w.role for w in self.registered.values()}
        return bool(roles & {"colocated", "mixed"}) or {"prefill", "decode"} <= roles

    def workers(self) -> list[WorkerView]:
        failed = [upkeep.failed_view(self, wid) for wid in self.failed_workers() if wid not in self.registered]
        return [self._view(w) for w in self.registered.values()] + failed

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    async def abort(self, request_id: str) -> None:
        live = self.live.pop(request_id, None)
        if live is None or live.done:
            return
        self.engine_ids.pop(live.engine_id, None)
        live.done = True
        for wid in {live.prefill_id, live.decode_id, *live.owners} - {""}:
            await self._send(wid, m.Abort(live.engine_id, "client_disconnect"))
        self.release(request_id, completed=False)
        self.metrics.requests.labels("aborted").inc()
        self.trace.write(live.record("abort"))

    async def submit(self, req: GenerationRequest) -> AsyncIterator:
        """Async generator of events; a Rejection raised before the first event means not admitted."""
        self._validate(req)
        seed = req.params.seed if req.params.seed is not None else int.from_bytes(os.urandom(7), "little")
        live = InFlight(req, seed, OutputCollector())
        self.live[req.request_id] = live
        try:
            await admission.admit(self, live)  # frontend_admission.py
        except BaseException as error:
            self.live.pop(req.request_id, None)
            live.done = True
            self._abandon(live)
            if isinstance(error, asyncio.CancelledError):  # the client left during admission (a fetch, say)
                self.metrics.requests.labels("aborted").inc()
                self.trace.write(live.record("abort"))
            raise
        try:
            while True:
                event = await live.outputs.get()
                yield event
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    return
        finally:
            if not live.done:
                await self.abort(req.request_id)

    def _abandon(self, live: InFlight) -> None:
        """Admission ended early (rejected, cancelled): a worker that already got a ReserveKv or
        Prefill for it must return what it holds. Scheduled as tasks: this runs while cancelling."""
        loop = asyncio.get_running_loop()
        for wid in {live.prefill_id, live.decode_id} - {""}:
            loop.create_task(self._send(wid, m.Abort(live.engine_id, "abandoned")))

    def _validate(self, req: GenerationRequest) -> None:
        """The checks a worker would make, made before any route or hold is taken."""
        req.params.validate()
        if not req.prompt_ids:
            raise InvalidRequest("prompt is empty")
        if len(req.prompt_ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(req.prompt_ids)} tokens; the context holds {self.max_model_len}")
        if self.vocab_size and any(t < 0 or t >= self.vocab_size for t in req.prompt_ids):
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})")
        if self.vocab_size and any(t >= self.vocab_size for t in req.params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids")

    # ---- what admission reads (frontend_admission.py) ------------------------------------
    def output_demand(self, req: GenerationRequest) -> int:
        """Output tokens to hold room for: n x (max_tokens, or the predicted bound under --reserve
        dynamic: tetri_runtime.py), and the partial block each fork copies."""
        return self.tetri.output_demand(req, self._block_size, self.max_model_len)

    def _block_hashes(self, prompt_ids: tuple[int, ...], tenant: str = DEFAULT_TENANT) -> tuple[int, ...]:
        if self._prefix_identity is None:
            return ()
        root = root_hash(self._prefix_identity, tenant)  # the tenant's own chain, as its workers hash it
        return tuple(map(hash_key, prompt_block_hashes(root, prompt_ids, self._block_size)))  # kv_index.py's keys

    def _bytes_per_token(self) -> int:
        return next(iter(self.registered.values())).bytes_per_token if self.registered else 0

    # ---- worker messages ------------------------------------------------------------------
    async def _send(self, worker_id: str, msg) -> bool:
        try:
            await self.sock.send_multipart([worker_id.encode(), m.encode(msg)])
            return True
        except zmq.ZMQError:
            return False

    async def _receive_loop(self) -> None:
        """Every message from the control socket: one that fails authentication, decoding or its
        handler is dropped and counted, never the end of this loop (control_auth.py)."""
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            msg, reason = self.control_auth.accept(frames)
            if msg is None:
                self.metrics.control_rejects.labels(reason).inc()
                continue
            try:
                await self._on_message(msg)
            except Exception:  # noqa: BLE001 - a message its handler cannot apply must not stop the router
                self.metrics.control_rejects.labels("invalid").inc()
                log.exception("router: dropped %s from %s", type(msg).__name__, msg.worker_id)

    async def _monitor_loop(self) -> None:
        """Connections that failed their handshake: no CURVE, not ZMTP, or a key this router did not issue."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if self.handshakes.on_event(event["event"], event["value"], time.monotonic()):
                self.metrics.control_rejects.labels("handshake").inc()

    def _current(self, msg) -> bool:
        reg = self.registered.get(msg.worker_id)
        return reg is not None and reg.epoch == msg.epoch

    async def _on_message(self, msg) -> None:
        if isinstance(msg, m.Register):
            self._on_register(msg)
            return
        if not self._current(msg):
            self.metrics.stale_messages.inc()
            return  # a retired epoch or an unknown worker: late message, rejected
        await ev.dispatch(self, msg)

    def _on_register(self, reg: m.Register) -> None:
        old = self.registered.get(reg.worker_id)
        retirement = self.router.register(WorkerInfo(reg.worker_id, reg.host_id, Role(reg.role), reg.epoch, reg.num_blocks,
                                                     reg.model_hash, reg.abi_hash, reg.tp))
        self.registered[reg.worker_id] = self.last_register[reg.worker_id] = reg
        self.on_worker_registered(reg.worker_id, reg.epoch)
        if self.router.route_epoch > 1:  # a rollback retired older route epochs: this incarnation refuses them too
            asyncio.get_running_loop().create_task(self._send(reg.worker_id, m.RouteEpoch(self.router.route_epoch)))
        if self.capabilities.key_epoch > 1:  # started before a rotation it was not asked about: the current key
            key = m.CapabilityKey(self.capabilities.public_key_hex, self.capabilities.key_epoch)
            asyncio.get_running_loop().create_task(self._send(reg.worker_id, key))  # ignored if it has it already
        self.loads.pop(reg.worker_id, None)  # a new epoch has reported no load yet: never show the old one's
        self.itl.forget(reg.worker_id)
        ev.forget_live_collectives(self, reg.worker_id)  # nor the old one's live collective gauges
        self.origin_roles.setdefault(reg.worker_id, reg.role)  # still away until its first load report (LIVE)
        self._block_size = reg.block_size
        self._prefix_identity = reg.prefix_identity or None
        if old is not None and retirement is not None:
            asyncio.get_running_loop().create_task(ev.on_worker_lost(self, reg.worker_id, retirement.orphaned_request_ids))

    # ---- upkeep (frontend_upkeep.py) -------------------------------------------------------
    async def _watchdog(self) -> None:
        await upkeep.watchdog(self)

    async def revoke_capabilities(self, ack_timeout_s: float | None = None) -> dict:
        return await upkeep.revoke_capabilities(self, ack_timeout_s)

    async def renew_leases(self) -> None:
        await upkeep.renew_leases(self)

    async def reap_lost_workers(self) -> None:
        await upkeep.reap_lost_workers(self)

    def _view(self, reg: m.Register) -> WorkerView:
        return upkeep.worker_view(self, reg)

    def report_load(self, hb: m.Heartbeat) -> None:
        upkeep.report_load(self, hb)
