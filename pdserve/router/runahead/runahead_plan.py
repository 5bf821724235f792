"""KV-Runahead partition search: where one prompt is cut between the K prefill workers of a chain.

Contract (pure, no I/O but `PartitionCache`'s file):
- Boundaries lie on the engine's chunk grid (multiples of the chunk budget C). Each worker runs
  its partition in the engine's own aligned chunks, so the chain computes exactly the chunks one
  worker would: its K/V bits equal single-worker chunked prefill (docs/architecture.md). The last
  partition may end on a partial chunk; every partition holds at least one chunk.
- Cost of one chunk is the `pdserve profile` prefill form a + b*rows + c*causal pairs, the pairs
  from the ledger's `triangular_work` over the prompt's chunks (spec 0x0CA); a chunk's layers take
  equal shares of it. Each stage prices its chunks with its own `ChunkCost` (its worker's TP
  size: a chain of a TP 2 and a TP 1 worker is searched with both prices; one `ChunkCost` stands
  for every stage); the single-worker time is the last stage's (the route's prefill worker).
- Critical path (`chain_finish_s`): worker i starts layer l of its first chunk once that layer of
  the prefix (S_{i-1} rows, the ledger's `prefix_sums_sent`) has arrived: the predecessor's last
  chunk finished layer l, plus the link's per-layer time (the cost model's `transfer_line`:
  overhead + S rows x bytes per layer token / bandwidth). Later chunks of a worker follow its
  first, whole. The chain's finish is the last worker's.
- The link is the handoff link's price (`LinkCost.of` a cost model: its same-host path, the
  router's measured one, router/pricing/link_rates.py, once transfers were published).
  `ChainCaches.follow_link` moves the search to a new price when it departs from the one searched
  with by more than `REPRICE` in either term (the search of a long K = 4 chain takes seconds, so
  not at every sample); the caches then start afresh.
- `search_partition` tries every composition of the prompt's chunks into K parts (the first
  `MAX_CANDIDATES`) and keeps the smallest finish (ties: the first in lexicographic order); None
  when the prompt has fewer than K chunks. `PartitionCache` keeps results per `RunaheadKey`
  (model hash, K, the stages' TP sizes in chain order, dtype, CPU kind) in memory and in
  `<cache root>/runahead/<key>.json`, entries keyed "C:tokens"; the file also records the
  stages' chunk costs and the link cost searched with, and another cost model starts it afresh.
  `ChainCaches` holds one per tuple of stage TP sizes, so a (2, 1) chain never reuses a (1, 1)
  chain's partition. A stage count that is not K, or a TP size below 1, raises ValueError.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pdserve.ledger.runahead import prefix_sums_sent, triangular_work
from pdserve.router.pricing.cost import CostModel, transfer_line

MAX_CANDIDATES = 50_000  # compositions tried at most; beyond it the chunks are split evenly
REPRICE = 0.25  # a link price that moved by more than this share in either term is searched again


@dataclass(frozen=True)
class ChunkCost:
    """Seconds of one prefill chunk: overhead_s + s_per_row * rows + s_per_pair * causal pairs."""

    overhead_s: float
    s_per_row: float
    s_per_pair: float = 0.0

    def chunk_s(self, rows: int, pairs: int) -> float:
        return self.overhead_s + self.s_per_row * rows + self.s_per_pair * pairs


@dataclass(frozen=True)
class LinkCost:
    """One chain link, per layer: overhead_s + prefix rows * bytes_per_layer_token / bytes_per_s."""

    overhead_s: float
    bytes_per_s: float
    bytes_per_layer_token: int

    @classmethod
    def of(cls, cost: CostModel, num_layers: int) -> LinkCost:
        """A chain link priced as `cost` prices a same-host handoff, one layer's share of its bytes."""
        return cls(cost.transfer_overhead_s, cost.same_host_bytes_per_s, cost.kv_bytes_per_token // num_layers)

    def layer_s(self, prefix_rows: int) -> float:
        return transfer_line(self.overhead_s, prefix_rows * self.bytes_per_layer_token, self.bytes_per_s)

    def departs_from(self, other: LinkCost) -> bool:
        """Whether this price moved from `other` by more than `REPRICE` in either term."""
        pairs = ((self.overhead_s, other.overhead_s), (self.bytes_per_s, other.bytes_per_s))
        return self.bytes_per_layer_token != other.bytes_per_layer_token or any(
            abs(a - b) > REPRICE * max(a, b) for a, b in pairs)


@dataclass(frozen=True)
class RunaheadPlan:
    partition: tuple[int, ...]  # prompt tokens per worker, in chain order
    predicted_s: float  # the chain's finish (critical path)
    single_s: float  # one worker's time for the same chunks


@dataclass(frozen=True)
class RunaheadKey:
    model_hash: str
    k: int
    dtype: str
    cpu_kind: str
    tps: tuple[int, ...]  # each stage's TP size, in chain order (k of them)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tps", tuple(self.tps))
        if len(self.tps) != self.k:
            raise ValueError(f"a K = {self.k} chain needs {self.k} stage TP sizes, got {self.tps}")
        if any(not isinstance(tp, int) or tp < 1 for tp in self.tps):
            raise ValueError(f"stage TP sizes must be integers >= 1, got {self.tps}")

    def file_name(self) -> str:
        sizes = "x".join(str(tp) for tp in self.tps)
        return f"{self.model_hash[:16]}-k{self.k}-tp{sizes}-{self.dtype}-{self.cpu_kind}.json"


def stage_costs(cost: ChunkCost | Sequence[ChunkCost], k: int) -> tuple[ChunkCost, ...]:
    """One `ChunkCost` per stage: `cost` for each of the k, or the k given (else ValueError)."""
    if isinstance(cost, ChunkCost):
        return (cost,) * k
    costs = tuple(cost)
    if len(costs) != k or not all(isinstance(c, ChunkCost) for c in costs):
        raise ValueError(f"need one ChunkCost per stage ({k}), got {len(costs)}")
    return costs


def prompt_chunks(num_tokens: int, chunk_tokens: int) -> list[int]:
    """The engine's aligned chunks of a prompt: C, C, ..., the remainder."""
    full, rest = divmod(num_tokens, chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


def chain_finish_s(partition: tuple[int, ...], chunk_tokens: int, num_layers: int,
                   cost: ChunkCost | Sequence[ChunkCost], link: LinkCost) -> float:
    """The critical path of `partition` (see the module contract); `cost`: one per stage, or one for all."""
    costs = stage_costs(cost, len(partition))
    chunks = prompt_chunks(sum(partition), chunk_tokens)
    pairs = triangular_work(chunks)  # causal pairs of each chunk, after the rows before it
    sent = prefix_sums_sent(partition) if len(partition) > 1 else []
    arrive = [0.0] * num_layers  # when layer l of this worker's prefix is here
    first, finish = 0, 0.0
    for i, rows in enumerate(partition):
        count = len(prompt_chunks(rows, chunk_tokens))
        mine = [costs[i].chunk_s(r, p) for r, p in zip(chunks[first:first + count], pairs[first:first + count])]
        first += count
        tau = mine[0] / num_layers
        end = 0.0
        done = []
        for layer in range(num_layers):
            end = max(end, arrive[layer]) + tau
            done.append(end)
        start_last = end + sum(mine[1:-1]) if count > 1 else None
        if start_last is not None:  # layer l of the last chunk ends (l + 1) shares after it starts
            tau_last = mine[-1] / num_layers
            done = [start_last + (layer + 1) * tau_last for layer in range(num_layers)]
        finish = done[-1]
        if i < len(sent):
            hop = link.layer_s(sent[i])
            arrive = [t + hop for t in done]
    return finish


def compositions(num_chunks: int, k: int):
    """Every way to give k workers >= 1 consecutive chunks each, as chunk counts."""
    for cuts in itertools.combinations(range(1, num_chunks), k - 1):
        bounds = (0, *cuts, num_chunks)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _tokens(counts: tuple[int, ...], chunks: list[int]) -> tuple[int, ...]:
    out, first = [], 0
    for n in counts:
        out.append(sum(chunks[first:first + n]))
        first += n
    return tuple(out)


def search_partition(num_tokens: int, k: int, chunk_tokens: int, num_layers: int,
                     cost: ChunkCost | Sequence[ChunkCost], link: LinkCost) -> RunaheadPlan | None:
    """The best partition on the chunk grid, or None when the prompt has fewer than k chunks;
    `cost`: each stage's chunk cost in chain order (or one for all)."""
    costs = stage_costs(cost, k)
    chunks = prompt_chunks(num_tokens, chunk_tokens)
    if k < 2 or len(chunks) < k:
        return None
    single = chain_finish_s((num_tokens,), chunk_tokens, num_layers, costs[-1], link)  # the route's worker alone
    best: tuple[float, tuple[int, ...]] | None = None
    for n, counts in enumerate(compositions(len(chunks), k)):
        if n >= MAX_CANDIDATES:
            break
        part = _tokens(counts, chunks)
        finish = chain_finish_s(part, chunk_tokens, num_layers, costs, link)
        if best is None or finish < best[0]:
            best = (finish, part)
    return RunaheadPlan(best[1], best[0], single)


class PartitionCache:
    """Searched partitions per `RunaheadKey`, in memory and (when `root` is set) on disk.

    The file holds {"key": ..., "costs": [per stage], "link": ..., "partitions": {"C:tokens":
    [n_0, ...]}}; its entries are used when key and costs match (searched on this model, K, stage
    TP sizes, dtype and CPU kind with these costs); otherwise they are searched again and the
    file rewritten. `cost`: each stage's chunk cost in chain order, or one for all."""

    def __init__(self, key: RunaheadKey, root: Path | None, cost: ChunkCost | Sequence[ChunkCost], link: LinkCost,
                 num_layers: int):
        self.key, self.costs, self.link, self.num_layers = key, stage_costs(cost, key.k), link, num_layers
        self.path = None if root is None else Path(root) / "runahead" / key.file_name()
        self.entries: dict[str, tuple[int, ...]] = {}
        self.num_searches = 0
        self._lock = threading.Lock()
        if self.path is not None and self.path.is_file():
            try:
                stored = json.loads(self.path.read_text())
                if {name: stored.get(name) for name in ("key", "costs", "link")} == self._header():
                    self.entries = {k: tuple(v) for k, v in stored.get("partitions", {}).items()}
            except (OSError, ValueError, AttributeError):
                self.entries = {}

    def _header(self) -> dict:
        """What a stored file must match, as JSON reads it back (tuples as lists)."""
        header = {"key": asdict(self.key), "costs": [asdict(c) for c in self.costs], "link": asdict(self.link)}
        return json.loads(json.dumps(header))

    def partition(self, num_tokens: int, chunk_tokens: int) -> tuple[int, ...] | None:
        name = f"{chunk_tokens}:{num_tokens}"
        with self._lock:
            if name in self.entries:
                return self.entries[name] or None
        plan = search_partition(num_tokens, self.key.k, chunk_tokens, self.num_layers, self.costs, self.link)
        with self._lock:
            self.num_searches += 1
            self.entries[name] = plan.partition if plan else ()
            self._save()
        return plan.partition if plan else None

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            body = {**self._header(), "partitions": {k: list(v) for k, v in sorted(self.entries.items())}}
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache root: the in-memory entries still serve


class ChainCaches:
    """One `PartitionCache` per tuple of stage TP sizes: a chain is searched with each stage's
    `stage_cost(tp)` under `key` with those sizes (its own file), so chains of different sizes
    never share a partition. `key`'s own `tps` is a template (only its other fields are used).
    Every cache searches with `link` (`follow_link` replaces it, module contract)."""

    def __init__(self, key: RunaheadKey, root: Path | None, stage_cost: Callable[[int], ChunkCost], link: LinkCost,
                 num_layers: int):
        self.key, self.root, self.stage_cost, self.link, self.num_layers = key, root, stage_cost, link, num_layers
        self.caches: dict[tuple[int, ...], PartitionCache] = {}
        self._lock = threading.Lock()

    def cache(self, tps: Sequence[int]) -> PartitionCache:
        """The cache of chains whose stages run at `tps` (chain order; K of them, each >= 1)."""
        tps = tuple(tps)
        with self._lock:
            found = self.caches.get(tps)
            if found is None:
                key = replace(self.key, tps=tps)  # checks the count and the sizes before any is priced
                costs = tuple(self.stage_cost(tp) for tp in tps)
                found = self.caches[tps] = PartitionCache(key, self.root, costs, self.link, self.num_layers)
        return found

    def follow_link(self, link: LinkCost) -> bool:
        """Search with `link` from now on if it departs from the price searched with (the caches
        start afresh); False: the price searched with stands."""
        with self._lock:
            if not link.departs_from(self.link):
                return False
            self.link, self.caches = link, {}
        return True

    def partition(self, num_tokens: int, chunk_tokens: int, tps: Sequence[int]) -> tuple[int, ...] | None:
        return self.cache(tps).partition(num_tokens, chunk_tokens)
