"""Metrics that add up under churn, kept by the router, and the same figures under vLLM's names.

Contract:
- Prefix hits are the router's own counters, so a worker's restart or re-registration never
  takes them back. `HitLedger.on_load` turns each worker's cumulative load counters (blocks its
  host tier promoted, host-tier blocks peers' fetches read in place) into increments per
  (worker, epoch): a new epoch counts from zero, a smaller value than the last under one epoch
  adds nothing. A finished request's cached prompt tokens are split into four disjoint `where`s:
  `remote_host` (fetched from a peer's host tier), `remote_device` (the rest of what its fetch
  brought), `local_host` (promoted from the prefilling worker's own host tier) and `local_device`
  (the rest). The local part settles at the prefilling worker's next load report, the remote part
  at the holder's (a report sent after the request finished counts what was promoted or read for
  it); host-tier tokens come from what the worker reported and no request has claimed yet, never
  more than the request's own tokens, so every counter only grows and, once settled, the four sum
  to the cached tokens of finished requests exactly.
- `pdserve_kv_tier_blocks{worker,tier,state}`: device used + cached + free = the pool's blocks,
  host used + free = its capacity, each state clamped at zero (a reserved block is used, never
  a negative free one).
- vLLM's names, labelled `model_name` (and `engine`, "0": the router is one engine to a
  dashboard): `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt tokens of finished
  requests / of them served from cached K/V, counters), `vllm:kv_cache_usage_perc` (used blocks
  over all workers' blocks, 0..1), `vllm:num_requests_running` / `vllm:num_requests_waiting`
  (requests a worker owns / still in admission), and the histograms
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds` (observed with pdserve's own: `RequestClocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

WHERE = ("local_device", "local_host", "remote_device", "remote_host")
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)  # vLLM's time-to-first-token buckets
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)  # vLLM's inter-token-latency buckets


class HitLedger:
    def __init__(self) -> None:
        self.tokens = dict.fromkeys(WHERE, 0)
        self.queries = 0  # prompt tokens of finished requests
        self._seen: dict[str, tuple[int, int, int]] = {}  # worker -> (epoch, host_hits, host_inplace_reads)
        self._promoted: dict[str, int] = {}  # per worker: host-tier tokens it promoted, not yet claimed
        self._read: dict[str, int] = {}  # per holder: host-tier tokens peers' fetches read in place, not yet claimed
        self._pending: dict[str, list[tuple[str, int]]] = {}  # worker -> ("local" | "remote", tokens) to settle

    def on_load(self, worker_id: str, epoch: int, load, block_size: int) -> None:
        """A worker's load report: its counters' increments, then the finished requests' tokens
        waiting on this worker (a report sent after a request finished counts what it promoted
        or was read for it)."""
        last_epoch, hits, reads = self._seen.get(worker_id, (epoch, 0, 0))
        if epoch < last_epoch:
            return  # a late report of a retired epoch
        if epoch != last_epoch:
            hits = reads = 0  # a new incarnation counts from zero
        new_hits, new_reads = max(0, load.host_hits - hits), max(0, load.host_inplace_reads - reads)
        self._seen[worker_id] = (epoch, max(hits, load.host_hits), max(reads, load.host_inplace_reads))
        self._promoted[worker_id] = self._promoted.get(worker_id, 0) + new_hits * block_size
        self._read[worker_id] = self._read.get(worker_id, 0) + new_reads * block_size
        for kind, tokens in self._pending.pop(worker_id, ()):
            pool = self._promoted if kind == "local" else self._read
            host = min(tokens, pool[worker_id])
            pool[worker_id] -= host
            self.tokens[f"{kind}_device"] += tokens - host
            self.tokens[f"{kind}_host"] += host

    def on_finished(self, prefill_id: str, holder: str | None, prompt_tokens: int, cached: int, remote: int) -> None:
        """A finished request: its prompt, its cached tokens and those of them its fetch brought
        from `holder`. Its local tokens settle at `prefill_id`'s next report, its remote ones at
        the holder's."""
        remote = min(remote, cached) if holder else 0
        self.queries += prompt_tokens
        if cached - remote:
            self._pending.setdefault(prefill_id, []).append(("local", cached - remote))
        if remote:
            self._pending.setdefault(holder, []).append(("remote", remote))

    def forget(self, worker_id: str) -> None:
        """A worker gone for good: what waits on it settles as device tokens."""
        for kind, tokens in self._pending.pop(worker_id, ()):
            self.tokens[f"{kind}_device"] += tokens

    @property
    def num_pending(self) -> int:
        """Finished requests' token parts still waiting on a worker's report."""
        return sum(map(len, self._pending.values()))

    @property
    def hits(self) -> int:
        return sum(self.tokens.values())


def register_serving_metrics(r: CollectorRegistry, model_name: str, loads: Callable[[], Mapping[str, object]],
                             live: Callable[[], Iterable[object]]) -> tuple[HitLedger, RequestClocks]:
    """Register this module's collectors on the router's registry: its hit ledger and clocks."""
    hits = HitLedger()
    r.register(HitTokens(hits, model_name))
    r.register(TierBlocks(loads, model_name))
    r.register(RequestCounts(live, model_name))
    return hits, RequestClocks(r, model_name)


class HitTokens:
    """`pdserve_prefix_hit_tokens_total{where}` and vLLM's prefix-cache counters, from a `HitLedger`."""

    def __init__(self, ledger: HitLedger, model_name: str):
        self.ledger, self.model_name = ledger, model_name

    def collect(self):
        family = CounterMetricFamily("pdserve_prefix_hit_tokens", "Prompt tokens of finished requests served from "
                                     "cached K/V, by where the K/V came from (disjoint)", labels=["where"])
        for where, tokens in self.ledger.tokens.items():
            family.add_metric([where], tokens)
        yield family
        labels, values = ["model_name", "engine"], [self.model_name, "0"]
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens", labels=labels)
        queries.add_metric(values, self.ledger.queries)
        yield queries
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens", labels=labels)
        hits.add_metric(values, self.ledger.hits)
        yield hits


class TierBlocks:
    """`pdserve_kv_tier_blocks{worker,tier,state}` and `vllm:kv_cache_usage_perc`, from the
    workers' last reported loads (at scrape time)."""

    def __init__(self, loads: Callable[[], Mapping[str, object]], model_name: str):
        self.loads, self.model_name = loads, model_name

    def collect(self):
        family = GaugeMetricFamily("pdserve_kv_tier_blocks", "K/V blocks per worker, tier and state",
                                   labels=["worker", "tier", "state"])
        used_total = blocks_total = 0
        for wid, load in sorted(self.loads().items()):
            free = min(max(0, load.free_blocks), load.num_blocks)  # reserved blocks are not free
            cached = min(max(0, load.cached_blocks), free)
            family.add_metric([wid, "device", "used"], load.num_blocks - free)
            family.add_metric([wid, "device", "cached"], cached)
            family.add_metric([wid, "device", "free"], free - cached)
            used_total, blocks_total = used_total + load.num_blocks - free, blocks_total + load.num_blocks
            if load.host_capacity:
                host_used = min(max(0, load.host_blocks), load.host_capacity)
                family.add_metric([wid, "host", "used"], host_used)
                family.add_metric([wid, "host", "free"], load.host_capacity - host_used)
                family.add_metric([wid, "host", "pinned"], min(max(0, load.host_pinned), host_used))
        yield family
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "K/V cache usage over every worker's pool (1 = 100%)",
                                  labels=["model_name", "engine"])
        usage.add_metric([self.model_name, "0"], used_total / blocks_total if blocks_total else 0.0)
        yield usage


class RequestCounts:
    """`vllm:num_requests_running` (a worker owns the request) and `vllm:num_requests_waiting`
    (still in admission), from the router's live requests."""

    def __init__(self, live: Callable[[], Iterable[object]], model_name: str):
        self.live, self.model_name = live, model_name

    def collect(self):
        owned = [bool(live.owners) for live in self.live()]
        for name, value, doc in (("vllm:num_requests_running", sum(owned), "Requests a worker is serving"),
                                 ("vllm:num_requests_waiting", len(owned) - sum(owned), "Requests waiting in admission")):
            family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
            family.add_metric([self.model_name, "0"], value)
            yield family


class RequestClocks:
    """Per-request clocks under pdserve's and vLLM's names: the inter-token gaps a client sees
    (each token event after the first, its gap spread over the tokens it carries), TTFT and
    end-to-end latency."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between consecutive output tokens "
                             "(sent to the client)", buckets=ITL_BUCKETS_S, registry=r)
        labels = ["model_name", "engine"]
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds", labels,
                                   buckets=LATENCY_BUCKETS_S, registry=r).labels(model_name, "0")
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds", labels,
                                  buckets=ITL_BUCKETS_S, registry=r).labels(model_name, "0")
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "End to end request latency in seconds",
                                  labels, buckets=LATENCY_BUCKETS_S, registry=r).labels(model_name, "0")

    def first_token(self, ttft_s: float) -> None:
        self.vllm_ttft.observe(ttft_s)

    def tokens(self, gap_s: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(gap_s / count)
            self.vllm_itl.observe(gap_s / count)

    def finished(self, e2e_s: float) -> None:
        self.vllm_e2e.observe(e2e_s)
