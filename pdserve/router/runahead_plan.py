"""KV-Runahead partition search: where one prompt is cut between the K prefill workers of a chain.

Contract (pure, no I/O but `PartitionCache`'s file):
- Boundaries lie on the engine's chunk grid (multiples of the chunk budget C). Each worker runs
  its partition in the engine's own aligned chunks, so the chain computes exactly the chunks one
  worker would: its K/V bits equal single-worker chunked prefill (docs/architecture.md). The last
  partition may end on a partial chunk; every partition holds at least one chunk.
- Cost of one chunk is the `pdserve profile` prefill form a + b*rows + c*causal pairs, the pairs
  from the ledger's `triangular_work` over the prompt's chunks (spec 0x0CA); a chunk's layers take
  equal shares of it.
- Critical path (`chain_finish_s`): worker i starts layer l of its first chunk once that layer of
  the prefix (S_{i-1} rows, the ledger's `prefix_sums_sent`) has arrived: the predecessor's last
  chunk finished layer l, plus the link's per-layer time (overhead + S rows x bytes per layer
  token / bandwidth). Later chunks of a worker follow its first, whole. The chain's finish is the
  last worker's.
- `search_partition` tries every composition of the prompt's chunks into K parts and keeps the
  smallest finish (ties: the first in lexicographic order), or an equal split when the prompt has
  too few chunks. `PartitionCache` keeps results per `RunaheadKey` (model hash, K, dtype, CPU
  kind) in memory and in `<cache root>/runahead/<key>.json`, entries keyed "C:tokens"; the file
  also records the chunk and link costs searched with, and another cost model starts it afresh.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.ledger.runahead import prefix_sums_sent, triangular_work

MAX_CANDIDATES = 50_000  # compositions tried at most; beyond it the chunks are split evenly


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

    def layer_s(self, prefix_rows: int) -> float:
        return self.overhead_s + prefix_rows * self.bytes_per_layer_token / self.bytes_per_s


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

    def file_name(self) -> str:
        return f"{self.model_hash[:16]}-k{self.k}-{self.dtype}-{self.cpu_kind}.json"


def prompt_chunks(num_tokens: int, chunk_tokens: int) -> list[int]:
    """The engine's aligned chunks of a prompt: C, C, ..., the remainder."""
    full, rest = divmod(num_tokens, chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


def chain_finish_s(partition: tuple[int, ...], chunk_tokens: int, num_layers: int, cost: ChunkCost,
                   link: LinkCost) -> float:
    """The critical path of `partition` (see the module contract)."""
    chunks = prompt_chunks(sum(partition), chunk_tokens)
    pairs = triangular_work(chunks)  # causal pairs of each chunk, after the rows before it
    secs = [cost.chunk_s(rows, p) for rows, p in zip(chunks, pairs)]
    sent = prefix_sums_sent(partition) if len(partition) > 1 else []
    arrive = [0.0] * num_layers  # when layer l of this worker's prefix is here
    first, finish = 0, 0.0
    for i, rows in enumerate(partition):
        count = len(prompt_chunks(rows, chunk_tokens))
        mine = secs[first:first + count]
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


def search_partition(num_tokens: int, k: int, chunk_tokens: int, num_layers: int, cost: ChunkCost,
                     link: LinkCost) -> RunaheadPlan | None:
    """The best partition on the chunk grid, or None when the prompt has fewer than k chunks."""
    chunks = prompt_chunks(num_tokens, chunk_tokens)
    if k < 2 or len(chunks) < k:
        return None
    single = chain_finish_s((num_tokens,), chunk_tokens, num_layers, cost, link)
    best: tuple[float, tuple[int, ...]] | None = None
    for n, counts in enumerate(compositions(len(chunks), k)):
        if n >= MAX_CANDIDATES:
            break
        part = _tokens(counts, chunks)
        finish = chain_finish_s(part, chunk_tokens, num_layers, cost, link)
        if best is None or finish < best[0]:
            best = (finish, part)
    return RunaheadPlan(best[1], best[0], single)


class PartitionCache:
    """Searched partitions per `RunaheadKey`, in memory and (when `root` is set) on disk.

    The file holds {"key": ..., "cost": ..., "link": ..., "partitions": {"C:tokens": [n_0, ...]}};
    its entries are used when key and costs match (searched on this model, K, dtype and CPU kind
    with these costs); otherwise they are searched again and the file rewritten."""

    def __init__(self, key: RunaheadKey, root: Path | None, cost: ChunkCost, link: LinkCost, num_layers: int):
        self.key, self.cost, self.link, self.num_layers = key, cost, link, num_layers
        self.path = None if root is None else Path(root) / "runahead" / key.file_name()
        self.entries: dict[str, tuple[int, ...]] = {}
        self.num_searches = 0
        self._lock = threading.Lock()
        if self.path is not None and self.path.is_file():
            try:
                stored = json.loads(self.path.read_text())
                if (stored.get("key"), stored.get("cost"), stored.get("link")) == (asdict(key), asdict(cost), asdict(link)):
                    self.entries = {k: tuple(v) for k, v in stored.get("partitions", {}).items()}
            except (OSError, ValueError):
                self.entries = {}

    def partition(self, num_tokens: int, chunk_tokens: int) -> tuple[int, ...] | None:
        name = f"{chunk_tokens}:{num_tokens}"
        with self._lock:
            if name in self.entries:
                return self.entries[name] or None
        plan = search_partition(num_tokens, self.key.k, chunk_tokens, self.num_layers, self.cost, self.link)
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
            body = {"key": asdict(self.key), "cost": asdict(self.cost), "link": asdict(self.link),
                    "partitions": {k: list(v) for k, v in sorted(self.entries.items())}}
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache root: the in-memory entries still serve
