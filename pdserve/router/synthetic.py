"""Seeded random clusters and requests for the router microbenchmark and tests.

Prompts share prefixes the way chat traffic does: a handful of "documents" (system prompts,
few-shot headers) form hash chains; a request continues one document's chain for a random
number of blocks and then diverges. Each worker holds random leading parts of some documents.
`EventFlow` then streams block events for those workers (as their heartbeats would), for the
cluster K/V index (kv_index.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.engine.kv.kv_events import BlockEvent, BlockEventKind, KvReport, KvTier
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.kv.kv_index import KvDelta
from pdserve.router.messages import Role, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.router import Router

MODEL, ABI = "synthetic-model", "synthetic-abi"


def chain(parent: int, salt: int, length: int) -> list[int]:
    """A hash chain of `length` blocks: each hash covers its parent's (as the engine's does)."""
    hashes = []
    for i in range(length):
        parent = hash((parent, salt, i)) & 0x7FFF_FFFF_FFFF_FFFF
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Workload:
    documents: tuple[tuple[int, ...], ...]
    seed: int

    @classmethod
    def make(cls, seed: int, num_documents: int = 16, document_blocks: int = 64) -> Workload:
        docs = tuple(tuple(chain(d, seed, document_blocks)) for d in range(num_documents))
        return cls(docs, seed)

    def held_prefixes(self, rng: random.Random) -> frozenset[int]:
        held: set[int] = set()
        for doc in rng.sample(self.documents, k=rng.randint(0, len(self.documents) // 2)):
            held.update(doc[: rng.randint(1, len(doc))])
        return frozenset(held)

    def request(self, rng: random.Random, request_id: str, block_size: int = 16) -> RouteRequest:
        doc = rng.choice(self.documents)
        shared = rng.randint(0, len(doc))
        own = rng.randint(0, 32)
        hashes = tuple(doc[:shared]) + tuple(chain(rng.getrandbits(62), self.seed, own))
        prompt_tokens = len(hashes) * block_size + rng.randint(1, block_size - 1)
        return RouteRequest(request_id, prompt_tokens, rng.randint(16, 512), hashes)


def random_load(rng: random.Random, capacity_blocks: int, held: frozenset[int] | None) -> WorkerLoad:
    return WorkerLoad(
        pending_prompt_tokens=rng.randint(0, 20_000),
        active_batch=rng.randint(0, 128),
        free_blocks=rng.randint(capacity_blocks // 10, capacity_blocks),
        prefix_hashes=held,
    )


def random_router(
    seed: int, num_prefill: int, num_decode: int, policy: str = "slo", num_hosts: int = 8, colocated: bool = False
) -> tuple[Router, Workload]:
    """A router with every worker registered and reporting a random load and prefix set."""
    rng = random.Random(seed)
    workload = Workload.make(seed)
    mode = Mode.COLOCATED if colocated else Mode.DISAGGREGATED
    router = Router(RouterConfig(mode, MODEL, ABI, policy=policy, ttft_slo_s=5.0, tpot_slo_s=0.05))
    roles = [Role.COLOCATED] * num_prefill if colocated else [Role.PREFILL] * num_prefill + [Role.DECODE] * num_decode
    for i, role in enumerate(roles):
        worker_id = f"{role.value[0]}{i:03d}"
        capacity = 20_000
        router.register(WorkerInfo(worker_id, f"host{i % num_hosts}", role, 1, capacity, MODEL, ABI))
        router.report_load(worker_id, 1, random_load(rng, capacity, workload.held_prefixes(rng)))
    return router, workload


class EventFlow:
    """Seeded block events per worker, every kind a host tier produces: each report evicts
    `events_per_report / 2` blocks the worker holds (a device block is DEMOTED to the host tier
    or REMOVED, one chance in two; once the host tier holds over half as many, a host-tier
    block is REMOVED instead) and brings as many in (one in
    four a host-tier block PROMOTED back when there is one, else a document block it lacks or a
    fresh chain hash STORED), numbered on from the worker's full set (sequence 0)."""

    def __init__(self, held: dict[str, frozenset[int]], workload: Workload, events_per_report: int = 64):
        self.held = {w: list(keys) for w, keys in held.items()}
        self.host: dict[str, list[int]] = {w: [] for w in held}  # each worker's host-tier blocks
        self.seq = dict.fromkeys(held, 0)
        self.workload, self.half = workload, max(1, events_per_report // 2)

    def report(self, rng: random.Random, worker_id: str) -> KvDelta:
        held, host, events = self.held[worker_id], self.host[worker_id], []
        members = set(held) | set(host)
        for _ in range(self.half):
            if host and (not held or len(host) > len(held) // 2):  # the host tier is full: its LRU goes
                gone = host.pop(rng.randrange(len(host)))
                members.discard(gone)
                events.append((BlockEventKind.REMOVED, gone, KvTier.HOST))
            elif held:
                i = rng.randrange(len(held))
                held[i], held[-1] = held[-1], held[i]
                gone = held.pop()
                if rng.random() < 0.5:
                    host.append(gone)
                    events.append((BlockEventKind.DEMOTED, gone, KvTier.HOST))
                else:
                    members.discard(gone)
                    events.append((BlockEventKind.REMOVED, gone, KvTier.DEVICE))
            if host and rng.random() < 0.25:
                back = host.pop(rng.randrange(len(host)))
                held.append(back)
                events.append((BlockEventKind.PROMOTED, back, KvTier.DEVICE))
                continue
            doc = rng.choice(self.workload.documents)
            key = doc[rng.randrange(len(doc))]
            if key in members:
                key = rng.getrandbits(62)
            held.append(key)
            members.add(key)
            events.append((BlockEventKind.STORED, key, KvTier.DEVICE))
        self.seq[worker_id] += len(events)
        return KvDelta(self.seq[worker_id], tuple(events))


def engine_report(delta: KvDelta) -> KvReport:
    """The report a worker's heartbeat would carry for `delta` (16-byte chain hashes whose first 8
    bytes are the routing keys, kv_index.hash_key), so the router's receive work is measured too."""
    events = tuple(BlockEvent(BlockEventKind(kind), key.to_bytes(8, "little") * 2, KvTier(tier))
                   for kind, key, tier in delta.events)
    return KvReport(delta.last_seq, events, delta.resync)
