"""A prefix fetch between two in-process workers' fetch sides (workers/prefix_fetch/fetch.py) over real
sockets and the shm pull transport: the fetched K/V is bitwise the K/V a third engine computes
for the same prefix, is inserted into the destination's prefix cache, and a request served after
it decodes the same tokens as one that recomputed; a tenant's fetch never matches another
tenant's blocks; a holder whose link dies mid-fetch ends in an abort with nothing inserted.
Every scenario ends with pins, endpoints and pools back at baseline."""

from __future__ import annotations

import queue
import random
import socket
import threading
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.frames import ManifestFrame
from pdserve.handoff.trace import TraceSink
from pdserve.workers import messages as m
from pdserve.workers.prefix_fetch.fetch import FetchSide
from pdserve.workers.handoff_io import HandoffSender

TINY = EngineConfig(model="tiny", kv_cache_bytes=8 << 20, num_threads=1)
BS = 16


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


class Node:
    """The parts of a Worker a FetchSide uses: engine (shared-memory pool), lock, events, send."""

    def __init__(self, wid: str, shm: bool = True):
        cfg = TINY if not shm else EngineConfig(**{**TINY.__dict__, "kv_shm_name": f"pdtest-{wid}-{random.getrandbits(32):08x}"})
        self.engine = Engine(cfg)
        self.id, self.epoch, self.lock = wid, 1, threading.RLock()
        self.events: queue.Queue = queue.Queue()
        self.sent: list = []
        self.trace, self.verifier = TraceSink(), None
        self.config = SimpleNamespace(handoff_host="127.0.0.1", lease_s=30.0)
        self.fetch = FetchSide(self)
        self.engine.external_tables = self.fetch.tables

    def send(self, msg) -> None:
        self.sent.append(msg)

    def pump(self, until, timeout_s: float = 30.0) -> None:
        """Run the worker loop's event side until `until()` holds."""
        import time
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, f"{self.id}: timed out, sent {self.sent}"
            try:
                kind, payload = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            self.fetch.on_event(kind, payload)

    def done(self, side: str):
        return [s for s in self.sent if isinstance(s, m.FetchDone) and s.side == side]

    def close(self) -> None:
        self.fetch.close()
        self.engine.pool.close(unlink=True)


def block_bytes(engine: Engine, block: int) -> torch.Tensor:
    return engine.pool.tensor[:, :, block].clone()  # every layer's K and V rows of one block


def fetch(holder: Node, dest: Node, ids: list[int], tenant: str = "default", fid: str = "f1") -> m.FetchReserved:
    n = len(ids) // BS
    dest.fetch.receive(m.FetchReserve(fid, tuple(ids[: n * BS]), tenant, holder.id, holder.epoch))
    reserved = dest.sent[-1]
    if not reserved.ok:
        return reserved
    plan = m.TransferPlan(fid, 1, m.FIRST_ATTEMPT, tenant, dest.id, dest.epoch, reserved.reservation_id,
                          reserved.dest_blocks, reserved.num_visible_blocks, "shm", dest.fetch.address,
                          dest.engine.pool.shm_name, dest.engine.pool.num_blocks)
    holder.fetch.receive(m.FetchServe(tuple(ids[: n * BS]), plan))
    return reserved


@pytest.fixture
def nodes():
    made = [Node("h"), Node("d")]
    yield made
    for node in made:
        node.close()


def baseline(*nodes: Node) -> None:
    for node in nodes:
        node.fetch.assert_no_leaks()
        node.engine.check_integrity()
        node.engine.assert_no_leaks()


def test_fetched_kv_is_bitwise_the_recomputed_kv_and_decodes_the_same_tokens(nodes):
    holder, dest = nodes
    history = prompt(100, 1)  # six full blocks
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=7)
    holder.engine.generate([history], params)
    reserved = fetch(holder, dest, history)
    assert reserved.ok and reserved.num_visible_blocks == 0 and len(reserved.dest_blocks) == 6
    dest.pump(lambda: dest.done("destination"))
    holder.pump(lambda: holder.done("source"))
    landed, served = dest.done("destination")[0], holder.done("source")[0]
    assert (landed.published, landed.blocks, served.published) == (True, 6, True)
    assert served.bytes == 6 * dest.engine.abi.bytes_per_block
    baseline(holder, dest)
    # inserted: the destination's own prefix cache now holds the six blocks
    hashes = dest.engine.blocks.hashes_for(history)
    assert dest.engine.blocks.match_prefix(hashes, history) == 6
    recompute = Engine(TINY)
    recompute.generate([history], params)
    for j, h in enumerate(hashes[:6]):
        fetched, computed = dest.engine.blocks.cached[h], recompute.blocks.cached[h]
        assert torch.equal(block_bytes(dest.engine, fetched), block_bytes(recompute, computed))
    turn2 = history + prompt(30, 2)
    out_fetch = dest.engine.generate([turn2], params)[0]
    out_recompute = Engine(TINY).generate([turn2], params)[0]
    assert out_fetch.num_cached_tokens == 96  # served from the fetched blocks
    assert out_fetch.output_ids == out_recompute.output_ids
    baseline(holder, dest)


def test_a_destination_fetches_only_what_it_lacks(nodes):
    holder, dest = nodes
    history = prompt(100, 4)
    holder.engine.generate([history], SamplingParams(max_tokens=2, ignore_eos=True))
    dest.engine.generate([history[:40]], SamplingParams(max_tokens=2, ignore_eos=True))  # two blocks of its own
    reserved = fetch(holder, dest, history)
    assert reserved.num_visible_blocks == 2 and len(reserved.dest_blocks) == 6
    dest.pump(lambda: dest.done("destination"))
    holder.pump(lambda: holder.done("source"))
    assert dest.done("destination")[0].blocks == 4
    assert holder.done("source")[0].bytes == 4 * dest.engine.abi.bytes_per_block
    baseline(holder, dest)


def test_another_tenants_prefix_is_never_found_at_the_holder(nodes):
    holder, dest = nodes
    history = prompt(64, 5)
    holder.engine.generate([history], SamplingParams(max_tokens=2, ignore_eos=True, tenant="alice"))
    reserved = fetch(holder, dest, history, tenant="bob")  # the router never plans this; the holder refuses it
    assert reserved.ok
    holder.pump(lambda: holder.done("source"))
    assert (holder.done("source")[0].published, holder.done("source")[0].reason) == (False, "holder_miss")
    dest.fetch.receive(m.FetchAbort("f1"))  # what the router sends on the holder's failure
    dest.pump(lambda: dest.done("destination"))
    assert dest.done("destination")[0].published is False
    assert dest.engine.blocks.match_prefix(dest.engine.blocks.hashes_for(history, "bob"), history) == 0
    baseline(holder, dest)


class DyingLink:
    """The holder's link dies right after its manifest: the holder process is gone mid-fetch."""

    def __init__(self, inner):
        self.inner, self.traffic = inner, inner.traffic

    def send(self, frame) -> None:
        self.inner.send(frame)
        if isinstance(frame, ManifestFrame):
            self.inner.channel.sock.shutdown(socket.SHUT_RDWR)  # the peer sees the connection drop

    def send_chunk(self, frame, payload) -> None:
        raise OSError("fault: holder died")

    def __getattr__(self, name):
        return getattr(self.inner, name)


class DyingSender(HandoffSender):
    def _open_link(self, plan, window):
        return DyingLink(super()._open_link(plan, window))


def test_holder_death_mid_fetch_aborts_inserts_nothing_and_returns_every_block(nodes):
    holder, dest = nodes
    history = prompt(100, 6)
    holder.engine.generate([history], SamplingParams(max_tokens=2, ignore_eos=True))
    holder.fetch.sender.__class__ = DyingSender
    fetch(holder, dest, history)
    dest.pump(lambda: dest.done("destination"))
    holder.pump(lambda: holder.done("source"))
    assert dest.done("destination")[0].published is False and holder.done("source")[0].published is False
    assert dest.engine.blocks.match_prefix(dest.engine.blocks.hashes_for(history), history) == 0  # nothing read
    baseline(holder, dest)
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=3)  # the request then recomputes, same tokens
    assert dest.engine.generate([history], params)[0].output_ids == Engine(TINY).generate([history], params)[0].output_ids


def test_pinning_never_eats_capacity_reserved_for_others(nodes):
    holder, dest = nodes
    history = prompt(100, 7)
    for node in nodes:
        node.engine.generate([history], SamplingParams(max_tokens=2, ignore_eos=True))
        node.engine.blocks.reserve("growth", node.engine.blocks.num_free)  # every free block promised away
    longer = history + prompt(40, 8)
    reserved = fetch(holder, dest, longer)
    assert (reserved.ok, reserved.reason) == (False, "no_kv_capacity")  # its own hit would revive reserved room
    dest.engine.blocks.release_reservation("growth")
    reserved = fetch(holder, dest, longer[:64] + prompt(80, 9), fid="f2")  # 4 own blocks; the holder lacks the rest
    holder.pump(lambda: holder.done("source"))
    assert holder.done("source")[0].reason == "holder_busy"  # pinning its 4 blocks would revive reserved room
    dest.fetch.receive(m.FetchAbort("f2"))
    dest.pump(lambda: dest.done("destination"))
    holder.engine.blocks.release_reservation("growth")
    baseline(holder, dest)
