"""Capabilities enforced by the memory owner on real handoff links (workers/handoff_io.py over
sockets, in-process): every bad capability is denied with its reason before a byte lands (the
destination pool is bitwise what it was), its blocks go back, the source learns the reason; a
source refuses a bad capability before it opens a link; a good one publishes bitwise-equal K/V
over TCP, shared-memory pull and staging. Plus the pull grant and the shm segments' mode."""

from __future__ import annotations

import os
import queue
import socket
import stat
import threading
import time

import msgspec
import pytest
import torch

from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.trust.capability import Verifier, peek
from pdserve.handoff.errors import UNAUTHENTICATED, RejectReason
from pdserve.handoff.frames import ManifestFrame, StagingHello
from pdserve.handoff.trust.guard import LinkGuard
from pdserve.handoff.kvbytes import pool_bytes
from pdserve.handoff.states import TxnState
from pdserve.handoff.transports.base import ChunkPayload
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.handoff.transports.copy import ShmReceiverLink
from pdserve.handoff.transports.pull import ShmPullReceiverLink, ShmPullSenderLink
from pdserve.router.process.capabilities import CapabilityIssuer
from pdserve.workers.handoff_io import HandoffListener, HandoffSender, prompt_digest
from pdserve.workers.messages import TransferPlan
from tests.handoff.world import ABI, IDENTITY, make_world, open_transfer, published_bytes_equal, reserve_request

PROMPT = tuple(range(3, 25))  # 22 tokens: 6 blocks of 4
ISSUER = CapabilityIssuer()
TRANSPORTS = {"tcp": ("tcp", False), "pull": ("shm", True), "staging": ("shm", False)}  # plan transport, src pool in shm


def trusting() -> Verifier:
    return Verifier(bytes.fromhex(ISSUER.public_key_hex), ISSUER.key_epoch)


@pytest.fixture(params=list(TRANSPORTS))
def rig(request):
    transport, shm = TRANSPORTS[request.param]
    world = make_world(num_tokens=len(PROMPT), shm=shm)
    world.dst_pool.tensor.copy_(torch.randn(world.dst_pool.tensor.shape, generator=torch.Generator().manual_seed(9))
                                .to(world.dst_pool.tensor.dtype))  # not zeros: "untouched" means something
    yield world, transport, request.param
    world.close()


def open_pair(world, transport: str, source_checks: bool):
    done: queue.Queue = queue.Queue()
    lock = threading.RLock()
    listener = HandoffListener(world.endpoint, lock, "127.0.0.1", verifier=trusting(),
                               on_done=lambda tid, state, txn: done.put(("destination", tid, state)))
    sender = HandoffSender("prefill-0", 3, world.src_pool, IDENTITY, world.trace, verifier=trusting() if source_checks else None,
                           on_done=lambda rid, src, dt, phys: done.put(("source", rid, src)))
    request = reserve_request(world, num_tokens=len(PROMPT))
    request = type(request)(**{**request.__dict__, "prompt_digest": prompt_digest(PROMPT)})
    with lock:
        reservation = world.endpoint.reserve(request)
    plan = TransferPlan(request.transfer_id, request.generation, request.attempt, request.tenant, world.endpoint.worker,
                        world.endpoint.epoch, reservation.reservation_id, tuple(reservation.prompt_blocks), 0, transport,
                        listener.address)
    return sender, listener, plan, request, done


def signed(plan: TransferPlan, world, issuer: CapabilityIssuer = ISSUER, **changes) -> bytes:
    """A capability for `plan` with some of its bound fields changed (the plan itself is not)."""
    bpb = changes.pop("bytes_per_block", ABI.bytes_per_block)
    pull = plan.transport == "shm" and world.src_pool.shm_name is not None
    return issuer.issue(msgspec.structs.replace(plan, **changes), "prefill-0", 3, ABI.abi_hash, pull, bpb).capability


def run(sender, plan, request, world, done, expect_both: bool) -> dict:
    sender.start(request.request_id, PROMPT, world.src_blocks, plan, request.tenant, "serialized")
    gate = sender.gate(request.request_id)
    if gate is not None:
        gate.mark_all_ready()
    ends = {}
    for _ in range(2 if expect_both else 1):
        side, _, value = done.get(timeout=30)
        ends[side] = value
    return ends


def test_a_capability_transfer_publishes_bitwise_identical_kv(rig):
    world, transport, _ = rig
    sender, listener, plan, request, done = open_pair(world, transport, source_checks=True)
    plan = msgspec.structs.replace(plan, capability=signed(plan, world))
    ends = run(sender, plan, request, world, done, expect_both=True)
    assert ends["source"].state is TxnState.PUBLISHED and ends["destination"] is TxnState.PUBLISHED
    assert [e.reason for e in world.trace.of("reject")] == []
    assert published_bytes_equal(world, request.request_id)
    listener.close()
    world.assert_no_leaks()


def _expired(plan, world):
    clock, ISSUER.clock = ISSUER.clock, lambda: time.time() - ISSUER.ttl_s - 1  # issued long ago, with the trusted key
    try:
        return signed(plan, world)
    finally:
        ISSUER.clock = clock


def _replayed(plan, world, listener):
    token = signed(plan, world)
    claims = peek(token)
    listener.verifier.replay.claim(claims.nonce, claims.expires_at, time.time())  # an earlier use of the same token
    return token


DENIALS = {
    "missing": (lambda plan, world, listener: None, RejectReason.CAPABILITY_MISSING),
    "forged": (lambda plan, world, listener: signed(plan, world, CapabilityIssuer()), RejectReason.CAPABILITY_FORGED),
    "expired": (lambda plan, world, listener: _expired(plan, world), RejectReason.CAPABILITY_EXPIRED),
    "replayed": (_replayed, RejectReason.CAPABILITY_REPLAYED),
    "wrong_region": (lambda plan, world, listener: signed(plan, world, dest_blocks=plan.dest_blocks[:-1] + (63,)),
                     RejectReason.CAPABILITY_REGION),
    "wrong_epoch": (lambda plan, world, listener: signed(plan, world, dest_epoch=plan.dest_epoch + 1),
                    RejectReason.CAPABILITY_MISMATCH),
    "over_bytes": (lambda plan, world, listener: signed(plan, world, bytes_per_block=ABI.bytes_per_block - 1),
                   RejectReason.CAPABILITY_BYTES),
    "wrong_destination": (lambda plan, world, listener: signed(plan, world, dest_worker="decode-9"),
                          RejectReason.CAPABILITY_MISMATCH),
    "wrong_transfer": (lambda plan, world, listener: signed(plan, world, transfer_id=plan.transfer_id + "x"),
                       RejectReason.CAPABILITY_MISMATCH),
}


@pytest.mark.parametrize("case", list(DENIALS))
def test_the_destination_denies_before_anything_lands_and_returns_the_blocks(rig, case, monkeypatch):
    world, transport, _ = rig
    make, reason = DENIALS[case]
    offered = []  # staging segments the destination created (none may exist before admission)
    real_open = ShmReceiverLink.open_staging
    monkeypatch.setattr(ShmReceiverLink, "open_staging", lambda link: (offered.append(link), real_open(link)))
    mapped = []  # source pools the destination attached to (none after a refusal)
    real_hello = ShmPullReceiverLink._on_hello
    monkeypatch.setattr(ShmPullReceiverLink, "_on_hello", lambda link, hello: (mapped.append(hello), real_hello(link, hello)))
    sender, listener, plan, request, done = open_pair(world, transport, source_checks=False)  # the bad token reaches D
    plan = msgspec.structs.replace(plan, capability=make(plan, world, listener))
    before = world.dst_pool.tensor.clone()
    free_before = world.blocks.num_free
    unauthenticated = reason in UNAUTHENTICATED
    ends = run(sender, plan, request, world, done, expect_both=not unauthenticated)
    txn = world.endpoint.transfers[plan.transfer_id]
    if unauthenticated:  # nobody the router sent: the link is turned away, the transfer waits for its source
        assert "destination" not in ends and txn.state is TxnState.RESERVED and done.empty()
        assert world.endpoint.claim(plan.transfer_id)  # the real source's link would still be admitted
        world.endpoint.unclaim(plan.transfer_id)
        world.endpoint.abort(plan.transfer_id, RejectReason.CANCELLED)  # the router's Abort, after the source's report
    else:
        assert (ends["destination"], txn.terminal_reason) == (TxnState.ABORTED, reason)
    assert (ends["source"].state, ends["source"].terminal_reason) == (TxnState.ABORTED, reason)  # told by the refusal
    assert torch.equal(world.dst_pool.tensor.view(torch.uint8), before.view(torch.uint8))  # bitwise untouched
    assert not world.blocks.is_reserved(plan.reservation_id) and world.blocks.num_free == free_before + 8  # 6 + growth 2
    assert [e.reason for e in world.trace.of("reject")] == [reason.value]
    assert offered == [] and mapped == []
    listener.close()
    world.assert_no_leaks()


@pytest.mark.parametrize("case", ["missing", "forged", "expired", "wrong_region", "wrong_epoch", "over_bytes",
                                  "wrong_destination", "wrong_transfer"])
def test_the_source_denies_before_it_opens_a_link(rig, case):
    world, transport, _ = rig
    make, reason = DENIALS[case]
    sender, listener, plan, request, done = open_pair(world, transport, source_checks=True)
    plan = msgspec.structs.replace(plan, capability=make(plan, world, listener))
    src_before, dst_before = world.src_pool.tensor.clone(), world.dst_pool.tensor.clone()
    ends = run(sender, plan, request, world, done, expect_both=False)
    assert (ends["source"].state, ends["source"].terminal_reason) == (TxnState.ABORTED, reason)
    assert world.endpoint.transfers[plan.transfer_id].state is TxnState.RESERVED  # no link, no manifest ever came
    assert torch.equal(world.src_pool.tensor.view(torch.uint8), src_before.view(torch.uint8))
    assert torch.equal(world.dst_pool.tensor.view(torch.uint8), dst_before.view(torch.uint8))
    world.endpoint.abort(plan.transfer_id, RejectReason.CANCELLED)  # the router's Abort, after the source's report
    listener.close()
    world.assert_no_leaks()


def test_a_landing_outside_the_capability_is_refused_and_nothing_is_written():
    world = make_world(num_tokens=len(PROMPT))
    try:
        request = reserve_request(world, num_tokens=len(PROMPT))
        manifest, src = open_transfer(world, request)
        txn = world.endpoint.transfers[request.transfer_id]
        plan = TransferPlan(request.transfer_id, request.generation, 1, request.tenant, "decode-0", 7,
                            txn.reservation.reservation_id, manifest.dst_blocks, 0, "tcp", ("127.0.0.1", 1))
        token = ISSUER.issue(plan, request.source_worker, request.source_epoch, ABI.abi_hash, False,
                             ABI.bytes_per_block).capability
        guard = LinkGuard(trusting(), world.endpoint, request.transfer_id, "push")
        assert guard.screen(ManifestFrame(manifest, token)) is None and guard.admitted
        world.endpoint.handle(ManifestFrame(manifest))
        guard.landing.regions = frozenset(manifest.dst_blocks[1:])  # as if the capability allowed fewer blocks
        src.gate.mark_all_ready()
        frame = src.begin_send(manifest.chunks[0].chunk_id)
        before = world.dst_pool.tensor.clone()
        assert guard.landing(frame) is None and guard.landing.denied.reason is RejectReason.CAPABILITY_REGION
        guard.landing.recv(_Replay(frame), 0.1)  # ends the grant the check took
        answers = guard.screen(frame)
        assert answers[0].published is False and answers[0].reason == RejectReason.CAPABILITY_REGION.value
        assert txn.state is TxnState.ABORTED and txn.quiescent
        assert torch.equal(world.dst_pool.tensor.view(torch.uint8), before.view(torch.uint8))
        src.abort(RejectReason.CAPABILITY_REGION)
        world.assert_no_leaks()
    finally:
        world.close()


class _Replay:
    def __init__(self, frame):
        self.frame = frame

    def recv(self, timeout_s, landing):
        return self.frame


def test_a_pull_receiver_copies_only_blocks_granted_for_its_transfer():
    world = make_world(num_tokens=len(PROMPT), shm=True)
    a, b = socket.socketpair()
    sender = ShmPullSenderLink(SocketChannel(a), world.src_pool.shm_name, world.src_pool.num_blocks)
    receiver = ShmPullReceiverLink(SocketChannel(b), world.endpoint.raw)
    try:
        request = reserve_request(world, num_tokens=len(PROMPT))
        manifest, src = open_transfer(world, request)
        sender.send(ManifestFrame(manifest))
        assert isinstance(receiver.recv(1.0, lambda f: None), ManifestFrame) and receiver.src_raw is None  # not revealed yet
        src.gate.mark_all_ready()
        spec = manifest.chunks[0]
        frame = src.begin_send(spec.chunk_id)
        payload = ChunkPayload(spec.layer, src.raw, tuple(src.chunk_src_blocks(spec)), tuple(manifest.chunk_dst_blocks(spec)))
        sender.send_chunk(frame, payload)
        dst = manifest.chunk_dst_blocks(spec)
        got = receiver.recv(1.0, lambda f: dst)
        assert receiver.landed_checksum(got) == frame.checksum and receiver.granted == frozenset(payload.src_blocks)
        before = world.dst_pool.tensor.clone()
        outside = tuple(b for b in range(world.src_pool.num_blocks) if b not in receiver.granted)[: len(dst)]
        sender.channel.send_frame(msgspec.structs.replace(frame, src_blocks=outside))  # names blocks never granted
        got = receiver.recv(1.0, lambda f: dst)
        assert receiver.landed_checksum(got) is None
        assert torch.equal(world.dst_pool.tensor.view(torch.uint8), before.view(torch.uint8))
    finally:
        receiver.close()
        sender.close()
        world.close()


def _mode(name: str) -> int:
    return stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode)


def test_shared_segments_are_owner_only_with_unguessable_names():
    a, b = socket.socketpair()
    receiver = ShmReceiverLink(SocketChannel(b), pool_bytes(KvPool(ABI, 4)))
    channel = SocketChannel(a)
    try:
        channel.send_frame(StagingHello(4096))
        b.settimeout(1.0)
        receiver.recv(0.2, lambda f: None)  # answers the hello with a staging offer
        name = receiver._shm.name
        assert _mode(name) == 0o600 and len(name.removeprefix("pdstage-")) == 32
    finally:
        receiver.close()
        channel.close()
    pool = KvPool(ABI, 4, shm_name="pdserve-test-pool")
    try:
        assert _mode(pool.shm_name) == 0o600
    finally:
        pool.close(unlink=True)
