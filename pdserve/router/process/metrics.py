"""Prometheus metrics of the serving runtime, in one private registry per router process.

Names are prefixed `pdserve_` and include every name the ledger's runtime-release check requires
(`pdserve check runtime-release --metrics URL` runs it on a live server). Counters mirror the
request life cycle: route decisions by policy and result (`pd_route`), per-request P/D decisions
(`pd_decisions_total{decision}`: disaggregate or local prefill), early rejections, K/V
transfer attempts / failures / chunk resends, logical and physical bytes moved, fallbacks,
stale or duplicate publication rejects, capability denials; histograms hold TTFT (first token
sent to the client), TPOT, transfer and exposed transfer seconds, rollback seconds; gauges hold
live workers by role, SLO attainment and per-worker queue depth and free blocks. Values the
router already keeps (route counts, registered workers, finished requests, the cluster K/V
index's entries, evictions, resyncs and memory estimate) are read at scrape time, so each has
one source of truth.
"""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.handoff.errors import CAPABILITY_DENIALS
from pdserve.ledger.goodput import attainment, joint_attainment
from pdserve.router.kv.kv_index import KvIndexStats

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
ROLES = ("prefill", "decode", "colocated", "mixed")
ClockSamples = tuple[Sequence[float], Sequence[float]]  # (TTFT s, TPOT s), one pair per finished request


class RouteDecisions:
    """Exports the control plane's own (policy, result) counters at scrape time: one source of truth."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]):
        self.read = read

    def collect(self):
        family = CounterMetricFamily("pdserve_pd_route", "Route decisions by policy and result", labels=["policy", "result"])
        for (policy, result), count in sorted(self.read().items()):
            family.add_metric([policy, result], count)
        yield family


class PdDecisions:
    """The router's per-request P/D decisions (disaggregate / local) at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, int]]):
        self.read = read

    def collect(self):
        family = CounterMetricFamily("pdserve_pd_decisions", "Per-request P/D decisions (router/policy/pd_decision.py)",
                                     labels=["decision"])
        counts = self.read()
        for decision in ("disaggregate", "local"):
            family.add_metric([decision], counts.get(decision, 0))
        yield family


class WorkersLive:
    """Registered workers by role at scrape time: a registration adds one, a retirement removes it."""

    def __init__(self, read: Callable[[], Iterable[str]]):
        self.read = read

    def collect(self):
        family = GaugeMetricFamily("pdserve_workers_live", "Registered (live) workers by role", labels=["role"])
        counts = Tally(self.read())
        for role in ROLES:
            family.add_metric([role], counts[role])
        yield family


class SloAttainment:
    """Fraction of recently finished requests that met the router's TTFT target, its TPOT target,
    and both, at scrape time (the ledger's attainment formulas); no sample before the first."""

    def __init__(self, read: Callable[[], ClockSamples], slo_s: tuple[float, float]):
        self.read, self.slo_s = read, slo_s

    def collect(self):
        family = GaugeMetricFamily("pdserve_slo_attainment", "Recent finished requests within the TTFT / TPOT SLO",
                                   labels=["clock"])
        (ttft, tpot), (ttft_slo, tpot_slo) = self.read(), self.slo_s
        if ttft:
            family.add_metric(["ttft"], attainment(ttft, ttft_slo))
            family.add_metric(["tpot"], attainment(tpot, tpot_slo))
            family.add_metric(["joint"], joint_attainment(ttft, tpot, ttft_slo, tpot_slo))
        yield family


class KvIndexMetrics:
    """The router's cluster K/V index (router/kv/kv_index.py) at scrape time: entries, its memory
    estimate, LRU evictions, resyncs asked for and applied."""

    def __init__(self, read: Callable[[], KvIndexStats | None]):
        self.read = read

    def collect(self):
        stats = self.read()
        if stats is None:
            return
        yield _gauge("pdserve_kv_index_entries", "Cluster K/V index entries (block hash, worker)", stats.entries)
        yield _gauge("pdserve_kv_index_memory_bytes", "Cluster K/V index memory estimate", stats.memory_bytes)
        evictions = CounterMetricFamily("pdserve_kv_index_evictions", "Index entries evicted past its bound (LRU)")
        evictions.add_metric([], stats.num_evictions)
        yield evictions
        resyncs = CounterMetricFamily("pdserve_kv_index_resyncs", "Full resyncs of a worker's prefix set, by stage",
                                      labels=["stage"])
        resyncs.add_metric(["requested"], stats.num_resyncs_requested)
        resyncs.add_metric(["applied"], stats.num_resyncs_applied)
        yield resyncs


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


class ReservationMetrics:
    """TetriInfer admission (router/tetri/reserve_mode.py, router/tetri/tetri_runtime.py): the reservation
    mode, how the length predictions scored (coverage: the output stayed under the predicted
    upper bound, so the hold never had to grow), the under- and over-predicted K/V bytes, the
    holds that grew and the requests preempted by recompute on their decode worker."""

    def __init__(self, r: CollectorRegistry):
        self.mode = Gauge("pdserve_reserve_mode", "Decode reservation mode in force (1 = this mode)", ["mode"], registry=r)
        self.outcomes = Counter("pdserve_prediction_outcomes", "Finished requests by prediction outcome "
                                "(covered, under: outgrew its bucket, over: stopped below it)", ["outcome"], registry=r)
        for outcome in ("covered", "under", "over"):
            self.outcomes.labels(outcome)
        self.coverage = Gauge("pdserve_prediction_coverage", "Share of predicted requests whose output stayed "
                              "under the predicted bucket's upper bound", registry=r)
        self.under_bytes = Counter("pdserve_prediction_underpredicted_bytes", "K/V bytes generated past the "
                                   "predicted upper bound", registry=r)
        self.over_bytes = Counter("pdserve_prediction_overpredicted_bytes", "Predicted-bound K/V bytes never used "
                                  "(stranded reservation)", registry=r)
        self.growths = Counter("pdserve_reservation_growths", "Decode holds grown past their reservation "
                               "(a request outgrew its predicted bucket)", registry=r)
        self.growth_blocks = Counter("pdserve_reservation_growth_blocks", "Blocks decode holds grew by", registry=r)
        self.preemptions = Counter("pdserve_reservation_preemptions", "Preemptions by recompute of requests under "
                                   "a predicted reservation, on their decode worker", registry=r)
        self._covered = self._predicted = 0

    def observe(self, outcome: str, under_bytes: int, over_bytes: int) -> None:
        self.outcomes.labels(outcome).inc()
        self.under_bytes.inc(under_bytes)
        self.over_bytes.inc(over_bytes)
        self._predicted += 1
        self._covered += outcome != "under"
        self.coverage.set(self._covered / self._predicted)


CONTROL_REJECTS = ("frames", "unknown_key", "decode", "identity", "epoch", "invalid", "handshake")


class RuntimeMetrics:
    def __init__(self, route_counts: Callable[[], Mapping[tuple[str, str], int]] = dict,
                 worker_roles: Callable[[], Iterable[str]] = tuple,
                 clock_samples: Callable[[], ClockSamples] = lambda: ((), ()),
                 slo_s: tuple[float, float] = (math.inf, math.inf),
                 pd_counts: Callable[[], Mapping[str, int]] = dict,
                 kv_index: Callable[[], KvIndexStats | None] = lambda: None) -> None:
        r = self.registry = CollectorRegistry()
        r.register(KvIndexMetrics(kv_index))
        r.register(RouteDecisions(route_counts))
        r.register(PdDecisions(pd_counts))
        r.register(WorkersLive(worker_roles))
        r.register(SloAttainment(clock_samples, slo_s))
        self.reservations = ReservationMetrics(r)
        self.early_rejections = Counter("pdserve_early_rejections", "Requests rejected before prefill", ["reason"], registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests", ["result"], registry=r)
        self.kv_transfer_bytes = Counter("pdserve_kv_transfer_bytes", "Logical K/V bytes of published transfers (their manifests' chunk bytes)", registry=r)
        self.kv_transfer_physical_bytes = Counter("pdserve_kv_transfer_physical_bytes",
                                                  "Bytes the handoff links carried (headers, payload, resends), published or aborted", registry=r)
        self.kv_transfer_attempts = Counter("pdserve_kv_transfer_attempts", "K/V transfers started", registry=r)
        self.kv_transfer_failures = Counter("pdserve_kv_transfer_failures", "K/V transfers aborted", ["reason"], registry=r)
        self.kv_transfer_retries = Counter("pdserve_kv_transfer_retries", "Chunk resends within K/V transfers (source side)", registry=r)
        self.kv_exposed_seconds = Histogram("pdserve_kv_transfer_exposed_seconds", "Transfer time not hidden behind prefill",
                                            buckets=LATENCY_BUCKETS_S, registry=r)
        self.kv_transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "Transfer wall time (source side)",
                                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.fallbacks = Counter("pdserve_fallback", "Decode-start fallbacks by outcome (router/process/recovery.py)", ["outcome"], registry=r)
        self.publication_rejects = Counter("pdserve_kv_publication_rejects", "Stale or duplicate publications refused", ["reason"], registry=r)
        self.capability_denials = Counter("pdserve_capability_denials",
                                          "Transfers denied by a capability check, by reason (handoff/trust/capability.py)",
                                          ["reason"], registry=r)
        for reason in CAPABILITY_DENIALS:  # every reason is exposed, at 0 until a denial
            self.capability_denials.labels(reason.value)
        self.rollback_seconds = Histogram("pdserve_rollback_seconds",
                                          "P/D to colocated rollback time (POST /admin/rollback)",
                                          buckets=LATENCY_BUCKETS_S, registry=r)
        self.role_changes = Counter("pdserve_role_changes", "Worker role changes by direction (workers/roles.py)",
                                    ["from_role", "to_role"], registry=r)
        self.pool_moves = Counter("pdserve_pool_moves", "Splitwise pool controller moves: lend, return, change "
                                  "(a loan adopted as the worker's role)", ["kind"], registry=r)
        self.stale_messages = Counter("pdserve_stale_messages",
                                      "Worker messages dropped for a retired or superseded epoch", registry=r)
        self.hung_workers = Counter("pdserve_hung_workers", "Workers retired for missed heartbeats and ended "
                                    "(restarted like a dead worker)", registry=r)
        self.workers_failed = Gauge("pdserve_workers_failed", "Workers past the restart crash-loop limit (1: FAILED, "
                                    "not started again; workers/process/supervisor.py)", ["worker"], registry=r)
        self.reroute_limits = Counter("pdserve_reroute_limit", "Requests ended with max_reroutes: their route broke "
                                      "once more after --max-reroutes moves", registry=r)
        self.control_rejects = Counter("pdserve_control_rejects", "Control-socket connections and messages dropped, "
                                       "by reason (router/process/control_auth.py)", ["reason"], registry=r)
        for reason in CONTROL_REJECTS:  # every reason is exposed, at 0 until a reject
            self.control_rejects.labels(reason)
        self.loop_failures = Counter("pdserve_router_loop_failures", "Router tasks that ended by an error "
                                     "(/health answers 503 after one)", ["task"], registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token (sent to the client)", buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "Time per output token after the first", buckets=TPOT_BUCKETS_S, registry=r)
        self.queue_depth = Gauge("pdserve_queue_pending_prompt_tokens", "Pending prompt tokens", ["worker"], registry=r)
        self.active_decode = Gauge("pdserve_active_decode_batch", "Sequences decoding", ["worker"], registry=r)
        self.free_blocks = Gauge("pdserve_free_blocks", "Free K/V blocks", ["worker"], registry=r)
        self.tp_collectives = Gauge("pdserve_tp_live_collective_seconds", "A TP worker's collectives per step as "
                                    "its rank 0's steps show them and the router prices them (router/pricing/live_collectives.py): "
                                    "term step = K alpha + sync, row = K B beta", ["worker", "phase", "term"], registry=r)
        self.tp_reports_ignored = Gauge("pdserve_tp_collective_reports_ignored", "TP collective report windows the "
                                        "router ignored since it started, by reason", ["reason"], registry=r)
        self.preemptions = Gauge("pdserve_engine_preemptions", "Engine preemptions (recompute) since the worker "
                                 "started, by cause: memory, or prompt_priority (Splitwise's mixed-machine rule)",
                                 ["worker", "cause"], registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
