"""Fault tests through the real shared-memory (staging and pull) and TCP transports, driven by the shared loops.

The destination never publishes a partial or corrupted cache; a retry under the same transfer id
is idempotent; a retry under a newer generation supersedes a killed attempt; nothing leaks."""

from __future__ import annotations

import random
import socket
import threading

import msgspec
import pytest

from pdserve.handoff.driver import DriveConfig, _payload, drive_source, serve_destination
from pdserve.handoff.endpoint import GrantedLanding
from pdserve.handoff.frames import ManifestFrame
from pdserve.handoff.kvbytes import pool_bytes
from pdserve.handoff.source import SourceTransfer
from pdserve.handoff.states import TxnState
from pdserve.handoff.transports.copy import ShmReceiverLink, ShmSenderLink
from pdserve.handoff.transports.pull import ShmPullReceiverLink, ShmPullSenderLink
from pdserve.handoff.transports.channels import SocketChannel
from pdserve.handoff.transports.tcp import TcpReceiverLink, TcpSenderLink, connect, listen_local

from tests.handoff.faults import FaultPlan, FaultySenderLink, _corrupted
from tests.handoff.world import ABI, finish, make_world, open_transfer, published_bytes_equal, reserve_request

CONFIG = DriveConfig(ack_timeout_s=0.15, give_up_s=15.0)


def shm_links(world):
    a, b = socket.socketpair()
    receiver = ShmReceiverLink(SocketChannel(b), world.endpoint.raw)
    return ShmSenderLink(SocketChannel(a), world.credits.capacity_bytes), receiver


def tcp_links(world):
    server = listen_local()
    client = connect(server.getsockname())
    conn, _ = server.accept()
    server.close()
    return TcpSenderLink(client), TcpReceiverLink(conn, world.endpoint.raw)


def pull_links(world):
    a, b = socket.socketpair()
    receiver = ShmPullReceiverLink(SocketChannel(b), world.endpoint.raw)
    return ShmPullSenderLink(SocketChannel(a), world.src_pool.shm_name, world.src_pool.num_blocks), receiver


LINKS = {"shm": shm_links, "tcp": tcp_links, "pull": pull_links}


def run_transfer(world, src, make_links, plan: FaultPlan | None = None):
    sender, receiver = make_links(world)
    link = FaultySenderLink(sender, plan) if plan else sender
    terminal = (TxnState.PUBLISHED, TxnState.ABORTED)
    dst = world.endpoint.transfers[src.manifest.transfer_id]
    # both ends terminal: an aborted source leaves the destination to notice the dead link itself
    done = lambda: src.state in terminal and dst.state in terminal  # noqa: E731
    server = threading.Thread(target=serve_destination,
                              args=(world.endpoint, receiver, src.manifest.transfer_id, CONFIG), kwargs={"until": done})
    server.start()
    drive_source(src, link, CONFIG)
    link.close()
    server.join(20)
    receiver.close()
    assert not server.is_alive()
    return link


@pytest.mark.parametrize("kind", sorted(LINKS))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_faulty_link_still_publishes_exact_bytes(kind, seed):
    world = make_world(num_tokens=37, credit_bytes=2048, shm=True, seed=seed)
    req = reserve_request(world, num_tokens=37)
    _, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    plan = FaultPlan(seed=seed, drop=0.1, delay=0.1, duplicate=0.1, corrupt=0.1)
    link = run_transfer(world, src, LINKS[kind], plan)
    assert sum(link.injected.values()) > 0
    assert src.state is TxnState.PUBLISHED, src.terminal_reason
    assert world.endpoint.transfers[req.transfer_id].state is TxnState.PUBLISHED
    assert published_bytes_equal(world, "req-1")
    finish(world, src)


@pytest.mark.parametrize("kind", sorted(LINKS))
def test_kill_mid_transfer_then_newer_generation_supersedes(kind):
    world = make_world(num_tokens=37, credit_bytes=2048, shm=True)
    old_req = reserve_request(world, num_tokens=37, generation=1)
    _, old = open_transfer(world, old_req)
    old.gate.mark_all_ready()
    run_transfer(world, old, LINKS[kind], FaultPlan(kill_after=5))
    assert old.state is TxnState.ABORTED and world.credits.in_flight == 0
    assert world.endpoint.transfers[old_req.transfer_id].state is TxnState.ABORTED
    assert world.endpoint.directory.lookup("req-1") is None  # nothing partial was published
    world.endpoint.supersede("req-1", 2)
    new_req = reserve_request(world, num_tokens=37, generation=2, attempt=1)
    _, new = open_transfer(world, new_req)
    new.gate.mark_all_ready()
    run_transfer(world, new, LINKS[kind])
    assert new.state is TxnState.PUBLISHED and published_bytes_equal(world, "req-1")
    assert world.endpoint.directory.owners() == {"req-1": new_req.transfer_id}
    finish(world, old, new)


@pytest.mark.parametrize("kind", sorted(LINKS))
def test_retry_under_same_transfer_id_is_idempotent(kind):
    world = make_world(num_tokens=37, credit_bytes=4096, shm=True)
    req = reserve_request(world, num_tokens=37)
    manifest, first = open_transfer(world, req)
    first.gate.mark_all_ready()
    run_transfer(world, first, LINKS[kind])
    assert first.state is TxnState.PUBLISHED
    again = SourceTransfer(manifest, pool_bytes(world.src_pool), world.src_blocks, world.credits, first.gate, world.trace)
    run_transfer(world, again, LINKS[kind], FaultPlan(seed=5, duplicate=0.3))
    assert again.state is TxnState.PUBLISHED
    assert world.endpoint.directory.owners() == {"req-1": req.transfer_id}
    assert published_bytes_equal(world, "req-1")
    finish(world, first, again)


def test_corrupted_only_link_never_publishes_wrong_bytes():
    """Every chunk corrupted on every send: the transfer gives up; nothing is published."""
    world = make_world(num_tokens=9, credit_bytes=4096, shm=True)
    req = reserve_request(world, num_tokens=9)
    _, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    run_transfer(world, src, tcp_links, FaultPlan(corrupt=1.0))
    assert src.state is TxnState.ABORTED
    assert world.endpoint.directory.lookup("req-1") is None
    finish(world, src)


def _answer_pending(world, receiver) -> list:
    """Serve every frame already waiting on the receiver; returns the answers it sent."""
    answers = []
    landing = GrantedLanding(world.endpoint)
    while (frame := landing.recv(receiver, 0.05)) is not None:
        for answer in world.endpoint.handle(frame):
            receiver.send(answer)
            answers.append(answer)
    return answers


@pytest.mark.parametrize("kind", sorted(LINKS))
def test_late_corrupted_duplicate_never_changes_published_bytes(kind):
    """A delayed duplicate of an accepted chunk, carrying other bytes, arrives after publication.
    Only the destination may write its pool: the duplicate is discarded, published bytes stay exact."""
    world = make_world(num_tokens=9, credit_bytes=4096, shm=True)
    req = reserve_request(world, num_tokens=9)
    _, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    sender, receiver = LINKS[kind](world)
    sender.send(ManifestFrame(src.manifest))
    _answer_pending(world, receiver)  # the manifest (and the shm link's staging handshake)
    first = None
    for spec in src.manifest.chunks:
        frame = src.begin_send(spec.chunk_id)
        sender.send_chunk(frame, _payload(src, spec.chunk_id))
        src.mark_sent(frame)
        first = first or frame
        for answer in _answer_pending(world, receiver):
            src.on_ack(answer)
    sender.send(src.seal())
    for answer in _answer_pending(world, receiver):
        src.on_publish_ack(answer)
    assert src.state is TxnState.PUBLISHED and published_bytes_equal(world, "req-1")
    late = msgspec.structs.replace(first, resend=1)
    sender.send_chunk(late, _corrupted(_payload(src, first.chunk_id), random.Random(0)))
    _answer_pending(world, receiver)
    assert published_bytes_equal(world, "req-1")
    sender.close()
    receiver.close()
    finish(world, src)
