"""Assembles a serving stack: worker processes, the router backend and the HTTP app.

Contract: `ServeConfig` is the one frozen description of a deployment (the CLI reads its
defaults from here). `cluster(config)` is an async context manager that starts the workers
(local processes, or Ray actors with `ray=True`), waits until all registered, yields the
`ClusterBackend` (with the start-up heap frozen, see heap.py), and on exit shuts every worker
down. While it runs, a supervisor task starts every dead worker again under its next epoch, on
the backoff of `config.restart` (`--no-restart` turns it off; past its crash-loop limit a worker
is FAILED and stays down); the router learns of the death through `launcher.dead` and of the new
incarnation when it registers. A worker the router retires for missed heartbeats (hung, e.g.
SIGSTOP) is ended by the launcher (SIGKILL after a grace) and so restarted like a dead one; so is
a restart that did not register within the policy's `register_timeout_s` (it sends no heartbeat).
`serve(config)` runs uvicorn on top, its connections under `config.http_limits` (api/edge/connections.py).
The model checkpoint is resolved (and the embedded default generated) once, before any worker
starts, so workers never race to write it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.api.edge.http_guard import DEFAULT_MAX_REQUEST_BODY_BYTES
from pdserve.api.edge.limits import EdgeLimits
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.heap import frozen_heap
from pdserve.model.config import load_config
from pdserve.model.cpu import summary as cpu_summary
from pdserve.model.default import resolve_model
from pdserve.model.loader import checkpoint_hash
from pdserve.model.tokenizer import load_tokenizer
from pdserve.router.config import ClusterShape, Mode, RouterConfig
from pdserve.router.policy.pd_decision import PdPolicy, served_pd, slo_line
from pdserve.router.pricing.calibration import AUTO, NONE, REFIT, cost_profile
from pdserve.router.pricing.tp_pricing import TpPricing, measured_tp, role_sizes, scaling_for
from pdserve.router.process.frontend import ClusterBackend
from pdserve.router.process.role_control import run_pool_controller
from pdserve.router.router import Router
from pdserve.router.runahead.runahead import make_runahead
from pdserve.router.splitwise.splitwise import PoolController, Thresholds
from pdserve.router.tetri.reserve_mode import load_policy
from pdserve.router.tetri.tetri_runtime import TetriRuntime
from pdserve.workers.kv_publisher import check_endpoints
from pdserve.workers.process.launcher import Launcher
from pdserve.workers.process.supervisor import RestartPolicy
from pdserve.workers.process.tp_rank import TpShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    num_mixed: int = 0  # splitwise mode: workers serving both phases (router/splitwise/mixed_pool.py)
    replicas: int = 2
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(kv_cache_bytes=256 << 20))
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "jsq"
    decode_choice: str = "policy"  # "p2c": the decode worker by power-of-two choices on heavy/light (router/tetri/decode_choice.py)
    reserve: str = "static"  # decode holds cover max_tokens, or "dynamic": the predicted bucket's bound (router/tetri/reserve_mode.py)
    predictor: str | None = None  # the output-length predictor file (`pdserve predictor train`); reserve "dynamic" needs it
    slo_ttft_s: float | None = None  # the SLO targets (P/D margin, admission); None: derived from the profile
    slo_tpot_s: float | None = None  # for the margin (pd_decision.decision_slos), ADMISSION_SLOS_S for admission
    threads_per_worker: int = 1
    pin_cpus: bool = True
    trace_dir: str | None = None
    layerwise_threshold_tokens: int = 256
    kv_events_endpoint: str | None = None  # vLLM-format KV events, worker i at this port + i (workers/kv_publisher.py)
    kv_events_replay_endpoint: str | None = None  # their replay sockets, likewise offset
    transport: str = "auto"  # "auto" (shm on one host, tcp across) | "shm" | "tcp"
    admission_wait_s: float = 30.0  # how long a request may queue for K/V capacity before a 503
    ray: bool = False
    ray_address: str | None = None
    ray_pack_pairs: bool = False
    startup_timeout_s: float = 180.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # dead workers start again (supervisor.py)
    lease_s: float = 30.0  # K/V held for a request whose router stopped renewing is reclaimed after this
    heartbeat_timeout_s: float = 10.0  # a worker silent this long is retired, ended and restarted (hung)
    step_timeout_s: float = 60.0  # a worker whose engine loop is stuck this long stops heartbeating (workers/heartbeat.py)
    max_reroutes: int = 2  # a request moved this many times to another worker ends with `max_reroutes` instead
    pd_decision: str = "margin"  # per request: "always" | "never" | "margin" (router/policy/pd_decision.py)
    pd_min_prompt_tokens: int = 0  # prompts with fewer uncached tokens at D prefill there, before the margin
    pd_safety_margin_s: float = 0.0  # the margin must exceed this to hand off
    pd_profile: str = "auto"  # the router's cost model: "auto" (fit on this machine at start when the margin
    # decides or the mode is colocated: its fetch decisions weigh measured link rates against the prefill they
    # save; kept on disk for later starts), "refit" (measure again), a `pdserve profile` JSON, or "none"
    # (placeholders; tests) (router/pricing/calibration.py)
    max_logprobs: int = 20  # the most top logprobs a request may ask for (api/protocol.py; more is a 400)
    admin_token: str | None = None  # mounts /admin/* (api/admin.py) behind this bearer token (a file or the environment)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger HTTP bodies answer 413 (api/edge/http_guard.py)
    http_limits: EdgeLimits = field(default_factory=EdgeLimits)  # connection cap, head and body deadlines (api/edge/limits.py)
    kv_index_max_entries: int = 524_288  # the router's cluster K/V index bound (router/kv/kv_index.py; LRU past it)
    tp: TpShape = field(default_factory=TpShape)  # tensor-parallel ranks per role (workers/process/tp_rank.py)
    prefill_runahead: int = 0  # K >= 2: long prompts prefilled by a chain of K prefill workers (router/runahead/runahead.py)
    runahead_min_tokens: int = 1024  # the shortest prompt a chain prefills
    kv_sharing: bool = True  # cross-worker prefix fetch and its routing credit; --no-kv-sharing turns it off
    api_keys: str | None = None  # a KEY -> TENANT file: generation needs a key and runs in its tenant (api/tenants.py)
    splitwise: Thresholds | None = None  # mode "splitwise": the pool controller's marks (default: from the SLOs)

    def __post_init__(self) -> None:
        if self.kv_index_max_entries < 1:
            raise ValueError(f"--kv-index-max-entries must be >= 1, got {self.kv_index_max_entries}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if not self.lease_s > 0:
            raise ValueError(f"--lease-s must be > 0, got {self.lease_s}")
        if not self.step_timeout_s >= 1.0:
            raise ValueError(f"--step-timeout-s must be >= 1, got {self.step_timeout_s}")
        if not self.heartbeat_timeout_s >= 1.0 or self.max_reroutes < 0:
            raise ValueError(f"--heartbeat-timeout-s must be >= 1 and --max-reroutes >= 0, got "
                             f"{self.heartbeat_timeout_s}, {self.max_reroutes}")
        PdPolicy(self.pd_decision, self.pd_min_prompt_tokens, self.pd_safety_margin_s)  # raises on a bad mode or floor
        if self.num_mixed and self.mode != "splitwise":
            raise ValueError(f"--mixed {self.num_mixed} goes with --mode splitwise (Splitwise's mixed pool)")
        if self.reserve not in ("static", "dynamic"):
            raise ValueError(f"--reserve must be static or dynamic, got {self.reserve!r}")
        if self.reserve == "dynamic" and not self.predictor:
            raise ValueError("--reserve dynamic needs --predictor P.json (train one: `pdserve predictor train TRACE.jsonl`)")
        self._check_runahead()
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint replays what --kv-events-endpoint publishes: give both")
        if self.kv_events_endpoint is not None:  # the per-worker port ranges (workers/kv_publisher.py)
            check_endpoints(self.kv_events_endpoint, self.kv_events_replay_endpoint, len(self.shape().roles()))
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Numbers no deployment can run with, refused before any process starts."""
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.threads_per_worker < 1 or self.layerwise_threshold_tokens < 0 or self.max_logprobs < 0:
            raise ValueError(f"--threads-per-worker must be >= 1, --layerwise-threshold and --max-logprobs >= 0, got "
                             f"{self.threads_per_worker}, {self.layerwise_threshold_tokens}, {self.max_logprobs}")
        for flag, seconds in (("--slo-ttft-ms", self.slo_ttft_s), ("--slo-tpot-ms", self.slo_tpot_s)):
            if seconds is not None and not seconds > 0:
                raise ValueError(f"{flag} must be > 0 (or left out: derived from the profile), got {seconds * 1e3:g}")
        if not self.admission_wait_s >= 0:
            raise ValueError(f"--admission-wait-s must be >= 0, got {self.admission_wait_s}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"--startup-timeout-s must be > 0, got {self.startup_timeout_s}")

    def _check_runahead(self) -> None:
        k = self.prefill_runahead
        if k < 0 or self.runahead_min_tokens < 1:
            raise ValueError("--prefill-runahead must be >= 0 and --runahead-min-tokens >= 1")
        if k >= 2 and (self.mode != "disaggregated" or self.num_prefill < k):
            raise ValueError(f"--prefill-runahead {k} needs disaggregated mode with at least {k} prefill workers")
        if k >= 2 and self.engine.max_num_batched_tokens % self.engine.block_size:
            raise ValueError("--prefill-runahead needs a chunk budget that is a multiple of the block size")

    def shape(self) -> ClusterShape:
        if self.mode == "colocated":
            return ClusterShape.colocated(self.replicas)
        return ClusterShape.disaggregated(self.num_prefill, self.num_decode, self.num_mixed)  # "splitwise" starts disaggregated

    def pool_thresholds(self) -> Thresholds:
        """Splitwise's marks: a prompt pool is pressed at a quarter of the TTFT target queued per worker."""
        ttft_s = self.admission_slos_s()[0]
        return self.splitwise or Thresholds(prompt_high_s=ttft_s / 4, prompt_low_s=ttft_s / 16)

    def admission_slos_s(self) -> tuple[float, float]:
        """(TTFT, TPOT) the slo and prefix policies refuse past: the user's, else ADMISSION_SLOS_S."""
        ttft_s, tpot_s = ADMISSION_SLOS_S
        return (ttft_s if self.slo_ttft_s is None else self.slo_ttft_s, tpot_s if self.slo_tpot_s is None else self.slo_tpot_s)


ADMISSION_SLOS_S = (30.0, 5.0)  # admission's backstop without user targets (the margin derives its own)


def _prices_on_this_machine(config: ServeConfig) -> bool:
    """Whether `--pd-profile auto` fits the cost model at start: the margin and colocated serving's
    fetch decisions need this machine's numbers; pinned P/D does not, nor one colocated replica
    without a host tier under a policy that does not price (no other holder to fetch from, no
    promotion to weigh, a queue-length choice)."""
    if config.mode != "colocated":
        return config.pd_decision == "margin"
    return config.replicas > 1 or config.engine.host_kv_bytes > 0 or config.policy not in ("jsq", "round_robin")


def router_for(config: ServeConfig, model_dir) -> Router:
    mc = load_config(model_dir)
    abi = KvAbi(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.engine.block_size, config.engine.dtype)
    source = config.pd_profile
    if source in (AUTO, REFIT) and not _prices_on_this_machine(config):
        source = NONE
    max_len = min(config.engine.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    tp = config.tp  # each worker's steps at its TP size, the role sizes' pair as `cost` (router/pricing/tp_pricing.py)
    sizes = role_sizes(config.mode, tp.prefill, tp.decode, tp.other)
    served = tuple(tp.for_role(role.value) for role in config.shape().roles())  # "auto" times their collectives
    try:
        profile = cost_profile(source, config.engine, config.threads_per_worker, model_dir, max_len, sizes[0], served)
    except (ValueError, RuntimeError) as exc:  # e.g. a step budget too small for the fit's prompt points
        raise StartFailed(f"the router's cost-model fit (--pd-profile {config.pd_profile}) failed: {exc}; "
                          f"`--pd-profile none` serves without one") from None
    cost, pd = served_pd(abi, profile, config.engine.max_num_batched_tokens, config.pd_decision,
                         config.pd_min_prompt_tokens, config.layerwise_threshold_tokens, config.pd_safety_margin_s,
                         config.slo_ttft_s, config.slo_tpot_s)  # the planner's too
    pricing = TpPricing(cost, scaling_for(mc, profile, config.threads_per_worker), measured_tp(profile))
    cost = pricing.pair(*sizes)
    # Local worker deaths are seen at once through their processes; heartbeats catch hung or
    # unreachable workers, so the timeout is generous (a long prefill step must not retire a worker).
    mode = Mode.COLOCATED if config.mode == "colocated" else Mode.DISAGGREGATED
    return Router(RouterConfig(mode, checkpoint_hash(model_dir), abi.abi_hash, policy=config.policy,
                               decode_choice=config.decode_choice,
                               cost=cost, pricing=pricing, ttft_slo_s=config.admission_slos_s()[0],
                               tpot_slo_s=config.admission_slos_s()[1],
                               heartbeat_interval_s=0.5, missed_heartbeats=round(config.heartbeat_timeout_s / 0.5), pd=pd,
                               kv_index_max_entries=config.kv_index_max_entries, kv_sharing=config.kv_sharing))


@contextlib.asynccontextmanager
async def cluster(config: ServeConfig) -> AsyncIterator[tuple[ClusterBackend, object]]:
    model_dir = resolve_model(config.engine.model)
    reserve = load_policy(config.reserve, config.predictor, model_dir)  # refuses another model's predictor
    mc = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    max_len = min(config.engine.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    trace = f"{config.trace_dir}/requests.jsonl" if config.trace_dir else None
    bind = "tcp://0.0.0.0:*" if config.ray else "tcp://127.0.0.1:*"
    launcher = Launcher(config)
    supervisor = pools = None
    backend = ClusterBackend(router_for(config, model_dir), model_name(config), tokenizer, max_len, bind, mc.vocab_size, trace,
                             is_dead=launcher.dead, transport=config.transport, admission_wait_s=config.admission_wait_s,
                             lease_renew_s=config.lease_s / 3, restarts=config.restart.enabled, kv_sharing=config.kv_sharing)
    if config.prefill_runahead >= 2:
        backend.runahead = make_runahead(config.prefill_runahead, config.runahead_min_tokens, model_dir, config.engine,
                                         backend.router.config.pricing, config.pd_profile, backend.metrics.registry)
    backend.on_role_changed = launcher.note_role
    backend.on_key_rotated = launcher.note_key
    backend.on_worker_registered, backend.on_worker_hung = launcher.note_registered, launcher.retire_hung
    backend.failed_workers, backend.max_reroutes = launcher.failed, config.max_reroutes
    backend.tetri = TetriRuntime(backend, reserve)
    backend.start()
    try:
        started = time.monotonic()  # --startup-timeout-s counts from here, the workers' launch included
        launcher.start(backend.address if not config.ray else _reachable(backend.address), backend.capabilities.public_key_hex,
                       backend.control_auth.issue)
        supervisor = asyncio.create_task(launcher.supervise())  # a worker killed during start-up is started again
        await _until_started(backend, launcher, len(config.shape().roles()), config.startup_timeout_s,
                             config.startup_timeout_s - (time.monotonic() - started))
        if config.mode == "splitwise":
            controller = PoolController(config.pool_thresholds(), prompt_pool_may_empty=config.pd_decision != "always")
            pools = asyncio.create_task(run_pool_controller(backend, controller))
        with frozen_heap():  # the router, app and tokenizer leave the collector's scans
            yield backend, launcher
    finally:
        if supervisor is not None:
            supervisor.cancel()
        if pools is not None:
            pools.cancel()
        await backend.close()
        await asyncio.get_running_loop().run_in_executor(None, launcher.stop)


class StartFailed(RuntimeError):
    """The server could not start for a reason its message gives (the CLI prints it, exit 1)."""


class WorkerStartFailed(TimeoutError):
    """A worker died during start-up and will not be started again (--no-restart, or FAILED)."""


async def _until_started(backend, launcher, count: int, timeout_s: float, left_s: float) -> None:
    """Every worker registered and reported once within `left_s` (of the start's `timeout_s`), or
    raise as soon as one is down for good (its exit and the supervisor's verdict are in the log
    above) instead of at the timeout."""
    waiting = asyncio.ensure_future(backend.wait_for_workers(count, max(0.0, left_s)))
    try:
        while not waiting.done():
            lost = launcher.down_for_good()
            if lost:
                raise WorkerStartFailed(f"{', '.join(lost)} died during start-up and will not be started again "
                                        f"({'FAILED: --max-crashes reached' if launcher.config.restart.enabled else '--no-restart'}; "
                                        f"its exit is logged above)")
            await asyncio.wait({waiting}, timeout=0.05)
        if isinstance(waiting.exception(), TimeoutError):
            missing = [w for w in launcher.impl.worker_ids() if w not in backend.registered or w not in backend.loads]
            raise WorkerStartFailed(f"{', '.join(missing)} did not register within {timeout_s:g} s of the start "
                                    f"(--startup-timeout-s): still loading, or hung (e.g. stopped)")
        waiting.result()
    finally:
        waiting.cancel()


def _loop_name() -> str:
    """The running event loop's kind: uvloop (pdserve/loop.py) or asyncio's own."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def model_name(config: ServeConfig) -> str:
    spec = config.engine.model
    return spec if spec in ("tiny", "small") else spec.rstrip("/").split("/")[-1]


def _begin_stop(backend: ClusterBackend, launcher: Launcher, loop: asyncio.AbstractEventLoop) -> None:
    """The server got its stop signal (this runs in the signal handler): no worker is started
    again, no request waits for one (a request whose worker died with the stop fails now instead
    of at its restart wait's end), none is admitted, and every open one ends now with an error
    event (`ClusterBackend.stop_serving`)."""
    launcher.begin_stop()
    backend.restarts = False
    loop.call_soon_threadsafe(backend.stop_serving)


def _workers_cpu(backend: ClusterBackend) -> dict:
    """A registered worker's CPU report (model/cpu.py): this process loads no torch to make its own."""
    return next(iter(backend.registered.values())).cpu


def _reachable(address: str) -> str:
    """tcp://0.0.0.0:PORT -> tcp://<this node's IP>:PORT for workers on other nodes."""
    import ray

    host = ray.util.get_node_ip_address()
    return address.replace("0.0.0.0", host)


async def serve(config: ServeConfig) -> None:
    import uvicorn

    from pdserve.api.app import create_app
    from pdserve.api.edge.connections import edge_protocol
    from pdserve.api.edge.stop import StoppingServer

    async with cluster(config) as (backend, launcher):
        from pdserve.api.tenants import load_api_keys

        keys = load_api_keys(config.api_keys) if config.api_keys else None
        app = create_app(backend, admin_token=config.admin_token, max_logprobs=config.max_logprobs, api_keys=keys,
                         max_request_body_bytes=config.max_request_body_bytes)
        server = StoppingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                               http=edge_protocol(config.http_limits)),
                                 functools.partial(_begin_stop, backend, launcher, asyncio.get_running_loop()),
                                 launcher.force_stop)
        print(f"pdserve: {config.mode} cluster ready, serving on http://{config.host}:{config.port} ({_loop_name()} loop); "
              f"{cpu_summary(_workers_cpu(backend))}", flush=True)
        if config.mode != "colocated":
            print(f"pdserve: {slo_line(backend.router.config.pd, backend.router.config.cost)}", flush=True)
        await server.serve()
    server.raise_stop_signals()  # once the workers are stopped (api/edge/stop.py)

