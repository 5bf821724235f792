"""`pdserve bench-transfer --fetch`: a cross-worker prefix fetch against a handoff, same bytes, same run.

Both arms run the worker layer's own code between two shared-memory K/V pools in this process
(the destination copies from the source's pool: the shm pull transport), interleaved round by
round, on a prefix of `nbytes` (default 24 MiB of the `small` geometry):
  handoff_inproc_gbps  HandoffSender -> HandoffListener/DecodeEndpoint: reserve -> publish
  fetch_gbps           FetchSide (holder, its cached blocks pinned) -> FetchSide (destination):
                       FetchReserve -> published and inserted into the destination's prefix cache
  fetch_host_gbps      the same fetch from a holder whose prefix sits in its host tier (a shared
                       segment): the destination reads the pinned host slots in place (issue 19 part 4)
  fetch_memcpy_gbps    one np.copyto of the same bytes between two private buffers, same rounds
  fetch_ratio          fetch_gbps / handoff_inproc_gbps; fetch_host_ratio fetch_host_gbps / fetch_gbps;
  *_memcpy_ratio       fetch_gbps and fetch_host_gbps over fetch_memcpy_gbps (medians over rounds)
No model runs: the holder's blocks hold random bytes registered under a prefix's chain hashes.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.host_tier import HostTier
from pdserve.engine.kv.kv_abi import CacheIdentity, KvAbi
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.destination import ReserveRequest
from pdserve.handoff.endpoint import DecodeEndpoint
from pdserve.handoff.reservations import PooledDestinationBlocks
from pdserve.handoff.trace import NullSink
from pdserve.workers import messages as m
from pdserve.workers.prefix_fetch.fetch import FetchSide
from pdserve.workers.handoff_io import HandoffListener, HandoffSender, prompt_digest

SMALL_ABI = KvAbi(num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
IDENTITY = CacheIdentity("bench-model", "bench-tok", SMALL_ABI.abi_hash)


class _Node:
    """A worker's parts a FetchSide uses, over a shared pool and a block manager (no model)."""

    def __init__(self, wid: str, num_blocks: int):
        self.id, self.epoch, self.lock = wid, 1, threading.RLock()
        self.pool = KvPool(SMALL_ABI, num_blocks, shm_name=f"pdbench-{wid}-{uuid.uuid4().hex[:12]}",
                           resident="all")
        self.engine = SimpleNamespace(pool=self.pool, identity=IDENTITY, blocks=None)
        self.events: queue.Queue = queue.Queue()
        self.sent: list = []
        self.trace, self.verifier = NullSink(), None
        self.config = SimpleNamespace(handoff_host="127.0.0.1", lease_s=60.0)
        self.fetch: FetchSide | None = None

    def fresh(self, host_blocks: int = 0) -> None:
        """An empty prefix cache (and host tier) and a new fetch side (the previous one's listener closed)."""
        if self.fetch is not None:
            self.fetch.close()
        self.engine.blocks = BlockManager(self.pool.num_blocks, SMALL_ABI.block_size, IDENTITY.identity_hash)
        if host_blocks:
            self.engine.blocks.host = HostTier(self.pool, host_blocks)
        self.fetch = FetchSide(self)

    def send(self, msg) -> None:
        self.sent.append(msg)

    def wait_done(self, side: str, timeout_s: float = 60.0) -> m.FetchDone:
        deadline = time.monotonic() + timeout_s
        while True:
            done = [s for s in self.sent if isinstance(s, m.FetchDone) and s.side == side]
            if done:
                self.sent.clear()
                return done[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.id}: no {side} FetchDone")
            try:
                kind, payload = self.events.get(timeout=0.01)
            except queue.Empty:
                continue
            self.fetch.on_event(kind, payload)

    def close(self) -> None:
        if self.fetch is not None:
            self.fetch.close()
        if self.engine.blocks is not None and self.engine.blocks.host is not None:
            self.engine.blocks.host.close()
        self.pool.close(unlink=True)


def _fill_holder(holder: _Node, tokens: list[int]) -> None:
    """Random K/V in every block, registered in the holder's prefix cache under `tokens`' hashes."""
    holder.pool.tensor.copy_(torch.randn(holder.pool.tensor.shape).to(holder.pool.tensor.dtype))
    bm, bs = holder.engine.blocks, SMALL_ABI.block_size
    blocks = bm.allocate(len(tokens) // bs)
    for j, (block, h) in enumerate(zip(blocks, bm.hashes_for(tokens))):
        bm.register(block, h, tuple(tokens[j * bs:(j + 1) * bs]))
    bm.release(blocks)  # cached, unreferenced: what a finished request leaves behind
    if bm.host is not None:  # demote the whole prefix: allocating every block evicts every cached one
        bm.release(bm.allocate(bm.num_blocks))
        if bm.host.num_used != len(blocks):
            raise AssertionError(f"host tier holds {bm.host.num_used} of {len(blocks)} blocks")


def _memcpy_once(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def _fetch_once(holder: _Node, dest: _Node, tokens: list[int], n: int) -> float:
    dest.fresh()
    fid = f"f{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    dest.fetch.receive(m.FetchReserve(fid, tuple(tokens), "default", holder.id, holder.epoch))
    r = dest.sent.pop()
    plan = m.TransferPlan(fid, 1, m.FIRST_ATTEMPT, "default", dest.id, dest.epoch, r.reservation_id, r.dest_blocks,
                          r.num_visible_blocks, "shm", dest.fetch.address, dest.pool.shm_name, dest.pool.num_blocks)
    holder.fetch.receive(m.FetchServe(tuple(tokens), plan))
    landed = dest.wait_done("destination")
    seconds = time.perf_counter() - t0
    holder.wait_done("source")
    if landed.blocks != n:
        raise AssertionError(f"fetch landed {landed.blocks} of {n} blocks")
    return seconds


def _handoff_once(holder: _Node, dest: _Node, tokens: list[int], n: int) -> float:
    done: queue.Queue = queue.Queue()
    lock = threading.RLock()
    endpoint = DecodeEndpoint("d0", 1, dest.pool, PooledDestinationBlocks(dest.pool.num_blocks), IDENTITY)
    listener = HandoffListener(endpoint, lock, "127.0.0.1", on_done=lambda tid, state, txn: done.put(state))
    sender = HandoffSender("h0", 1, holder.pool, IDENTITY, NullSink(), on_done=lambda *a: done.put(a))
    tid = f"x{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.perf_counter()
        with lock:
            res = endpoint.reserve(ReserveRequest(tid, "default", tid, 1, m.FIRST_ATTEMPT, "h0", 1, prompt_digest(tokens),
                                                  len(tokens), n))
        plan = m.TransferPlan(tid, 1, m.FIRST_ATTEMPT, "default", "d0", 1, res.reservation_id, res.prompt_blocks, 0, "shm",
                              listener.address, dest.pool.shm_name, dest.pool.num_blocks)
        sender.start(tid, tuple(tokens), list(range(n)), plan, "default", "serialized")
        sender.gate(tid).mark_all_ready()
        ends = [done.get(timeout=60) for _ in range(2)]
        seconds = time.perf_counter() - t0
    finally:
        listener.close()
    if endpoint.transfers[tid].state.name != "PUBLISHED":
        raise AssertionError(f"handoff ended {endpoint.transfers[tid].state.name}: {ends}")
    return seconds


def fetch_vs_handoff(runs: int, nbytes: int = 24 << 20) -> dict:
    """Medians over `runs` interleaved rounds (see the module docstring)."""
    n = -(-nbytes // SMALL_ABI.bytes_per_block)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 250, n * SMALL_ABI.block_size)]
    holder, host_holder, dest = _Node("h0", n), _Node("h1", n), _Node("d0", n)
    holder.fresh()
    host_holder.fresh(host_blocks=n)
    moved = n * SMALL_ABI.bytes_per_block
    src, dst = np.ones(moved, dtype=np.uint8), np.zeros(moved, dtype=np.uint8)  # pages touched before timing
    samples: dict[str, list[float]] = {"fetch": [], "handoff": [], "fetch_host": [], "memcpy": []}
    try:
        _fill_holder(holder, tokens)
        _fill_holder(host_holder, tokens)
        for run in range(runs):
            arms = (("fetch", lambda: _fetch_once(holder, dest, tokens, n)),
                    ("fetch_host", lambda: _fetch_once(host_holder, dest, tokens, n)),
                    ("handoff", lambda: _handoff_once(holder, dest, tokens, n)),
                    ("memcpy", lambda: _memcpy_once(src, dst)))
            for name, once in arms if run % 2 == 0 else arms[::-1]:
                samples[name].append(once())
        if host_holder.engine.blocks.host.num_hits:
            raise AssertionError("the host-tier holder promoted blocks: the arm did not read in place")
    finally:
        for node in (holder, host_holder, dest):
            node.close()
    gbps = {k: moved / statistics.median(v) / 1e9 for k, v in samples.items()}
    return {"fetch_bytes": moved, "fetch_gbps": gbps["fetch"], "handoff_inproc_gbps": gbps["handoff"],
            "fetch_host_gbps": gbps["fetch_host"], "fetch_memcpy_gbps": gbps["memcpy"],
            "fetch_ratio": gbps["fetch"] / gbps["handoff"], "fetch_host_ratio": gbps["fetch_host"] / gbps["fetch"],
            "fetch_memcpy_ratio": gbps["fetch"] / gbps["memcpy"],
            "fetch_host_memcpy_ratio": gbps["fetch_host"] / gbps["memcpy"],
            "fetch_samples_ms": {k: [round(t * 1e3, 2) for t in v] for k, v in samples.items()}}
