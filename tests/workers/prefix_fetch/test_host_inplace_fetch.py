"""Prefix fetches that read a holder's host tier in place (workers/prefix_fetch/fetch_holder.py, issue 19
part 4), between in-process fetch sides over real sockets, the shm pull transport and
capabilities: host slots fetched in place land bitwise equal to the same prefix fetched from a
holder's device pool (and to a recompute) with no promotion at the holder, over shm pull and TCP; the tier's eviction
is held off while a fetch pins its slots and takes them after release; an expired lease unpins
and the fetch fails cleanly to recompute; a holder that dies mid-read leaves pools, pins and
credits at baseline and the request recomputes the same tokens; a capability for one slot set
reads no other (refused at the holder, and at a reader whose holder sends other slots).
Every scenario ends with every pool's integrity and leak checks."""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import msgspec
import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.trust.capability import Verifier
from pdserve.handoff.trace import TraceSink
from pdserve.router.process.capabilities import CapabilityIssuer
from pdserve.workers import messages as m
from pdserve.workers.prefix_fetch.fetch import FetchSide
from pdserve.workers.prefix_fetch.fetch_holder import DEVICE, HOST
from pdserve.workers.handoff_io import HandoffSender
from tests.workers.prefix_fetch.test_prefix_fetch import BS, TINY, DyingLink, Node, block_bytes, prompt

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True, seed=3)
BPB = Engine(TINY).abi.bytes_per_block


class HostNode(Node):
    """A fetch side with capabilities on, over an engine whose pool (and host tier, if any) is
    shared memory; it records the source transfers its holder side ends."""

    def __init__(self, wid: str, issuer: CapabilityIssuer, num_blocks: int | None = None, host_blocks: int = 0,
                 lease_s: float = 30.0):
        cfg = replace(TINY, kv_shm_name=f"pdtest-{wid}-{random.getrandbits(32):08x}", num_blocks=num_blocks,
                      host_kv_bytes=host_blocks * BPB)
        self.engine = Engine(cfg)
        self.id, self.epoch, self.lock = wid, 1, threading.RLock()
        self.events: queue.Queue = queue.Queue()
        self.sent: list = []
        self.trace, self.verifier = TraceSink(), Verifier(bytes.fromhex(issuer.public_key_hex))
        self.config = SimpleNamespace(handoff_host="127.0.0.1", lease_s=lease_s)
        self.fetch = FetchSide(self)
        self.engine.external_tables = self.fetch.tables
        self.sources: list = []
        served = self.fetch.holder.served
        self.fetch.holder.served = lambda fid, src, *rest: (self.sources.append(src), served(fid, src, *rest))[1]

    @property
    def host(self):
        return self.engine.blocks.host

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(n for n in (self.engine.pool.shm_name, self.host.shm_name if self.host else None) if n)

    def close(self) -> None:
        super().close()
        if self.host is not None:
            self.host.close()


@pytest.fixture
def issuer():
    return CapabilityIssuer()


@pytest.fixture
def made():
    nodes: list[HostNode] = []
    yield nodes
    for node in nodes:
        node.close()


def holder_with_host_history(issuer, made, history, lease_s=30.0, host_blocks=40, tenant="default") -> HostNode:
    """A holder whose 20-block device pool evicted `history` into its host tier."""
    holder = HostNode("h", issuer, num_blocks=20, host_blocks=host_blocks, lease_s=lease_s)
    made.append(holder)
    put_in_host(holder, history, tenant)
    return holder

def holder_and_destination(issuer, made, seed: int, **holder_kw) -> tuple[list[int], HostNode, HostNode]:
    """A 100-token history (six full blocks) evicted into a holder's host tier, and an empty
    destination node: the set-up of every fetch scenario below."""
    history = prompt(100, seed)
    holder = holder_with_host_history(issuer, made, history, **holder_kw)
    dest = HostNode("d", issuer)
    made.append(dest)
    return history, holder, dest



def put_in_host(holder: HostNode, history, tenant="default") -> None:
    holder.engine.generate([history], replace(PARAMS, tenant=tenant))
    hashes = holder.engine.blocks.hashes_for(history, tenant)[: len(history) // BS]
    for seed in range(100, 130):  # short prompts through 20 blocks until the history is all demoted
        holder.engine.generate([prompt(40, seed)], PARAMS)
        if all(h in holder.host.lru for h in hashes):
            break
    assert all(h in holder.host.lru and h not in holder.engine.blocks.cached for h in hashes)


def plan_fetch(issuer, holder, dest, ids, fid="f1", tenant="default", bind=None, transport="shm") -> tuple:
    """What the router does (router/kv/fetch_runner.py): reserve and pin, then serve a plan naming
    the pinned (segment, slot) pairs, its capability binding them (or `bind`, a wrong set)."""
    n = len(ids) // BS
    prefix = tuple(ids[: n * BS])
    dest.fetch.receive(m.FetchReserve(fid, prefix, tenant, holder.id, holder.epoch))
    holder.fetch.receive(m.FetchPin(fid, prefix, tenant, n))
    reserved, pinned = dest.sent[-1], holder.sent[-1]
    assert reserved.ok and pinned.ok, (reserved, pinned)
    slots = tuple(pinned.src_slots[reserved.num_visible_blocks:])
    plan = m.TransferPlan(fid, 1, m.FIRST_ATTEMPT, tenant, dest.id, dest.epoch, reserved.reservation_id,
                          reserved.dest_blocks, reserved.num_visible_blocks, transport, dest.fetch.address,
                          dest.engine.pool.shm_name, dest.engine.pool.num_blocks, src_slots=bind or slots)
    plan = issuer.issue(plan, holder.id, holder.epoch, dest.engine.abi.abi_hash, transport == "shm", BPB, holder.segments)
    if bind is not None:
        plan = msgspec.structs.replace(plan, src_slots=slots)  # the plan names the pins; the capability does not
    return prefix, plan, pinned


def serve(holder, prefix, plan) -> None:
    holder.fetch.receive(m.FetchServe(prefix, plan))


def finish(holder, dest) -> tuple[m.FetchDone, m.FetchDone]:
    dest.pump(lambda: dest.done("destination"))
    holder.pump(lambda: holder.done("source"))
    return dest.done("destination")[-1], holder.done("source")[-1]


def baseline(*nodes: HostNode) -> None:
    for node in nodes:
        node.fetch.assert_no_leaks()  # fetch pins, host-tier pins and endpoints
        node.engine.check_integrity()  # the device pool, and the host tier's check
        node.engine.assert_no_leaks()
        for src in node.sources:
            src.credits.assert_no_leaks()


def fetched(node: HostNode, ids, n: int) -> list[torch.Tensor]:
    hashes = node.engine.blocks.hashes_for(ids)[:n]
    return [block_bytes(node.engine, node.engine.blocks.cached[h]) for h in hashes]


def test_host_slots_read_in_place_land_bitwise_as_the_device_pool_path(issuer, made):
    history = prompt(100, 1)  # six full blocks
    holder = holder_with_host_history(issuer, made, history)
    dev_holder, dest, dest2 = HostNode("g", issuer), HostNode("d", issuer), HostNode("e", issuer)
    made += [dev_holder, dest, dest2]
    dev_holder.engine.generate([history], PARAMS)  # the same prefix in a device pool
    prefix, plan, pinned = plan_fetch(issuer, holder, dest, history)
    assert [seg for seg, _ in pinned.src_slots] == [HOST] * 6  # every block is read from a host slot
    serve(holder, prefix, plan)
    landed, served = finish(holder, dest)
    assert (landed.published, landed.blocks, served.published, served.bytes) == (True, 6, True, 6 * BPB)
    prefix2, plan2, pinned2 = plan_fetch(issuer, dev_holder, dest2, history, fid="f2")
    assert [seg for seg, _ in pinned2.src_slots] == [DEVICE] * 6
    serve(dev_holder, prefix2, plan2)
    assert finish(dev_holder, dest2)[0].published
    in_place, from_device = fetched(dest, history, 6), fetched(dest2, history, 6)
    computed = fetched(dev_holder, history, 6)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(in_place, from_device, computed))
    assert (holder.host.num_hits, holder.host.num_inplace_reads) == (0, 6)  # nothing promoted
    assert all(h in holder.host.lru for h in holder.engine.blocks.hashes_for(history)[:6])
    baseline(holder, dev_holder, dest, dest2)
    turn2 = history + prompt(30, 2)
    out = dest.engine.generate([turn2], PARAMS)[0]
    assert out.num_cached_tokens == 96 and out.output_ids == Engine(TINY).generate([turn2], PARAMS)[0].output_ids
    baseline(holder, dest)


def test_over_tcp_the_holder_sends_host_slots_in_place(issuer, made):
    history, holder, dest = holder_and_destination(issuer, made, 3)
    prefix, plan, _ = plan_fetch(issuer, holder, dest, history, transport="tcp")
    slots = [holder.host.lru[h][0] for h in holder.engine.blocks.hashes_for(history)[:6]]
    serve(holder, prefix, plan)
    assert all(finished.published for finished in finish(holder, dest))
    assert all(torch.equal(a, b) for a, b in zip(fetched(dest, history, 6), holder.host.pool.tensor[:, :, slots].unbind(2)))
    assert (holder.host.num_hits, holder.host.num_inplace_reads) == (0, 6)
    baseline(holder, dest)


def test_eviction_is_held_off_while_pinned_and_happens_after_release(issuer, made):
    history, holder, dest = holder_and_destination(issuer, made, 4, host_blocks=8)
    prefix, plan, pinned = plan_fetch(issuer, holder, dest, history)
    slots = [slot for _, slot in pinned.src_slots]
    before = holder.host.pool.tensor[:, :, slots].clone()
    evictions = holder.host.num_evictions
    for seed in range(200, 203):  # more demotions than the tier's two unpinned slots hold
        holder.engine.generate([prompt(150, seed)], PARAMS)
    assert holder.host.num_evictions > evictions + 2  # eviction ran, and skipped the pinned slots
    hashes = holder.engine.blocks.hashes_for(history)[:6]
    assert [holder.host.lru[h][0] for h in hashes] == slots
    assert torch.equal(holder.host.pool.tensor[:, :, slots], before)
    serve(holder, prefix, plan)
    landed, served = finish(holder, dest)
    assert landed.published and served.published
    assert all(torch.equal(a, b) for a, b in zip(fetched(dest, history, 6), before.unbind(2)))
    baseline(holder, dest)
    holder.engine.generate([prompt(150, 300)], PARAMS)  # released: the next demotions take them
    assert not any(h in holder.host.lru for h in hashes)
    baseline(holder, dest)


def test_lease_expiry_unpins_and_the_fetch_fails_cleanly_to_recompute(issuer, made):
    history = prompt(100, 5)
    holder = holder_with_host_history(issuer, made, history, lease_s=0.3)
    dest = HostNode("d", issuer, lease_s=0.3)
    made.append(dest)
    prefix, plan, pinned = plan_fetch(issuer, holder, dest, history)
    assert holder.host.num_pinned == 6
    time.sleep(0.5)  # the router went quiet: nobody serves the fetch
    holder.fetch.tick()
    dest.fetch.tick()
    assert holder.host.num_pinned == 0 and not holder.fetch.holder.pinned
    assert holder.fetch.leases.num_expired == 1 and dest.fetch.leases.num_expired == 1
    serve(holder, prefix, plan)  # a late FetchServe is refused: its lease ended
    landed, served = finish(holder, dest)
    assert (landed.published, served.published, served.reason) == (False, False, "aborted")
    baseline(holder, dest)
    assert dest.engine.blocks.match_prefix(dest.engine.blocks.hashes_for(history), history) == 0
    out = dest.engine.generate([history], PARAMS)[0]  # the request recomputes: same tokens
    assert out.output_ids == Engine(TINY).generate([history], PARAMS)[0].output_ids
    baseline(holder, dest)


class DiesAfterOneChunk(DyingLink):
    """The holder dies mid-read: one chunk reaches the reader, then the link drops."""

    def send(self, frame) -> None:
        self.inner.send(frame)

    def send_chunk(self, frame, payload) -> None:
        if getattr(self, "sent_one", False):
            self.inner.channel.sock.shutdown(2)
            raise OSError("fault: holder died mid-read")
        self.sent_one = True
        self.inner.send_chunk(frame, payload)


class DyingSender(HandoffSender):
    def _open_link(self, plan, window):
        return DiesAfterOneChunk(super()._open_link(plan, window))


def test_holder_death_mid_read_recomputes_with_pools_pins_and_credits_at_baseline(issuer, made):
    history, holder, dest = holder_and_destination(issuer, made, 6)
    holder.fetch.holder.sender.__class__ = DyingSender
    prefix, plan, _ = plan_fetch(issuer, holder, dest, history)
    serve(holder, prefix, plan)
    landed, served = finish(holder, dest)
    assert (landed.published, served.published) == (False, False)
    assert holder.host.num_inplace_reads == 0 and holder.host.num_pinned == 0
    assert dest.engine.blocks.match_prefix(dest.engine.blocks.hashes_for(history), history) == 0  # nothing inserted
    baseline(holder, dest)
    out = dest.engine.generate([history], PARAMS)[0]
    assert out.output_ids == Engine(TINY).generate([history], PARAMS)[0].output_ids
    baseline(holder, dest)


def test_a_capability_for_other_slots_is_refused_at_the_holder(issuer, made):
    history, holder, dest = holder_and_destination(issuer, made, 7)
    other = ((HOST, 39),) * 6
    prefix, plan, _ = plan_fetch(issuer, holder, dest, history, bind=other)
    serve(holder, prefix, plan)
    holder.pump(lambda: holder.done("source"))
    assert holder.done("source")[-1].reason == "capability_source"
    dest.fetch.receive(m.FetchAbort("f1"))  # what the router sends on the holder's failure
    dest.pump(lambda: dest.done("destination"))
    assert dest.done("destination")[-1].published is False
    baseline(holder, dest)


def test_a_reader_never_copies_slots_its_capability_does_not_name(issuer, made):
    """The holder serves bob's prefix under a capability naming bob's slots but (a fault)
    sends chunks from alice's: the reader's link refuses every one and nothing lands."""
    alice, bob = prompt(100, 8), prompt(100, 9)
    holder = holder_with_host_history(issuer, made, alice, tenant="alice")
    put_in_host(holder, bob, tenant="bob")
    assert all(h in holder.host.lru for h in holder.engine.blocks.hashes_for(alice, "alice")[:6])
    dest = HostNode("d", issuer)
    made.append(dest)
    alice_slots = [holder.host.lru[h][0] for h in holder.engine.blocks.hashes_for(alice, "alice")[:6]]
    alice_addresses = [holder.fetch.holder.sources.address(HOST, s) for s in alice_slots]
    start = holder.fetch.holder.sender.start
    holder.fetch.holder.sender.start = lambda fid, ids, src_blocks, *rest: start(fid, ids, alice_addresses, *rest)
    prefix, plan, _ = plan_fetch(issuer, holder, dest, bob, tenant="bob")
    dest_blocks = list(plan.dest_blocks)
    before = dest.engine.pool.tensor[:, :, dest_blocks].clone()
    serve(holder, prefix, plan)
    landed, served = finish(holder, dest)
    assert (landed.published, served.published) == (False, False)
    assert torch.equal(dest.engine.pool.tensor[:, :, dest_blocks], before)  # not one byte of alice's copied
    assert dest.engine.blocks.match_prefix(dest.engine.blocks.hashes_for(bob, "bob"), bob) == 0
    baseline(holder, dest)
