"""The pull transport: the destination copies from the source's shared pool and never writes it."""

from __future__ import annotations

import socket

import msgspec
import numpy as np
import pytest

from pdserve.handoff.driver import _payload
from pdserve.handoff.endpoint import GrantedLanding
from pdserve.handoff.frames import ChunkFrame, ManifestFrame, SourcePoolHello
from pdserve.handoff.kvbytes import chunk_checksum, copy_and_checksum, pool_bytes
from pdserve.handoff.states import TxnState
from pdserve.handoff.transports.base import LinkClosed
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.handoff.transports.pull import ShmPullReceiverLink
from tests.handoff.faults import FaultPlan
from tests.handoff.test_transports import pull_links, run_transfer
from tests.handoff.world import finish, make_world, open_transfer, published_bytes_equal, reserve_request


@pytest.fixture
def world():
    w = make_world(num_tokens=37, credit_bytes=4096, shm=True)
    yield w
    w.close()


def _answer(world, receiver) -> list:
    answers = []
    landing = GrantedLanding(world.endpoint)
    while (frame := landing.recv(receiver, 0.05)) is not None:
        landed = receiver.landed_checksum(frame) if isinstance(frame, ChunkFrame) else None
        for answer in world.endpoint.handle(frame, landed):
            answers.append(answer)
    return answers


def test_copy_and_checksum_matches_separate_copy_and_hash(world):
    src, dst = pool_bytes(world.src_pool), pool_bytes(world.dst_pool)
    src_blocks, dst_blocks = [3, 4, 9, 10, 11, 0], [7, 8, 20, 21, 2, 30]
    digest = copy_and_checksum(src, src_blocks, dst, dst_blocks, layer=1)
    assert digest == chunk_checksum(dst, 1, dst_blocks) == chunk_checksum(src, 1, src_blocks)
    for s, d in zip(src_blocks, dst_blocks):
        assert np.array_equal(src[1, :, s], dst[1, :, d])


def test_pull_publishes_exact_bytes_and_never_writes_the_source(world):
    before = pool_bytes(world.src_pool).copy()
    _, src = open_transfer(world, reserve_request(world, num_tokens=37))
    src.gate.mark_all_ready()
    run_transfer(world, src, pull_links)
    assert src.state is TxnState.PUBLISHED and published_bytes_equal(world, "req-1")
    assert np.array_equal(pool_bytes(world.src_pool), before)
    finish(world, src)


def test_wrong_source_blocks_only_never_publish(world):
    _, src = open_transfer(world, reserve_request(world, num_tokens=37))
    src.gate.mark_all_ready()
    run_transfer(world, src, pull_links, FaultPlan(corrupt=1.0))
    assert src.state is TxnState.ABORTED and world.endpoint.directory.lookup("req-1") is None
    finish(world, src)


@pytest.mark.parametrize("bad", ["out_of_range", "short", "negative"])
def test_malformed_source_blocks_leave_the_pool_untouched(world, bad):
    _, src = open_transfer(world, reserve_request(world, num_tokens=37))
    src.gate.mark_all_ready()
    sender, receiver = pull_links(world)
    sender.send(ManifestFrame(src.manifest))
    _answer(world, receiver)
    spec = src.manifest.chunks[0]
    frame = src.begin_send(spec.chunk_id)
    payload = _payload(src, spec.chunk_id)
    blocks = {"out_of_range": (world.src_pool.num_blocks,) * spec.count, "short": payload.src_blocks[:-1],
              "negative": (-1,) * spec.count}[bad]
    landing = list(src.manifest.chunk_dst_blocks(spec))
    dst = pool_bytes(world.dst_pool)
    before = dst[spec.layer, :, landing].copy()
    sender.send(msgspec.structs.replace(frame, src_blocks=blocks))  # bypass send_chunk: a forged frame
    src.mark_sent(frame)
    answers = _answer(world, receiver)
    assert answers and not answers[0].visible  # refused (checksum of untouched blocks), to be resent
    assert np.array_equal(dst[spec.layer, :, landing], before)
    sender.close()
    receiver.close()
    finish(world, src)


def test_unknown_short_or_early_source_pool_is_refused(world):
    manifest, src = open_transfer(world, reserve_request(world, num_tokens=37))
    a0, b0 = socket.socketpair()
    receiver = ShmPullReceiverLink(SocketChannel(b0), world.endpoint.raw)
    SocketChannel(a0).send_frame(SourcePoolHello(world.src_pool.shm_name, world.src_pool.num_blocks))
    with pytest.raises(LinkClosed, match="before any manifest"):  # no pool is mapped before the link's manifest
        receiver.recv(1.0, world.endpoint.landing_blocks)
    assert receiver.src_raw is None
    receiver.close()
    for name, num_blocks, match in (("pd-no-such-pool", 4, "no-such-pool"),
                                    (world.src_pool.shm_name, world.src_pool.num_blocks * 100, "announced")):
        a, b = socket.socketpair()
        receiver = ShmPullReceiverLink(SocketChannel(b), world.endpoint.raw)
        channel = SocketChannel(a)
        channel.send_frame(ManifestFrame(manifest))
        assert isinstance(receiver.recv(1.0, world.endpoint.landing_blocks), ManifestFrame)
        channel.send_frame(SourcePoolHello(name, num_blocks))
        with pytest.raises(LinkClosed, match=match):
            receiver.recv(1.0, world.endpoint.landing_blocks)
        receiver.close()
        a.close()
    a0.close()
    finish(world, src)
