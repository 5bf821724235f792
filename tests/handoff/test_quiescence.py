"""Quiescence before release: an aborted destination keeps its blocks until in-flight writes end.

The race this pins down: a transport got landing blocks for a chunk (outside the worker lock it
then copies the payload), the request is aborted meanwhile (client gone, reroute, worker error),
and another request reserves blocks. Without quiescence the abort returned the blocks at once and
the late copy wrote into K/V the other request already owned.
"""

from __future__ import annotations

import pytest

from pdserve.handoff.endpoint import GrantedLanding
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import ManifestFrame
from pdserve.handoff.kvbytes import chunk_views
from pdserve.handoff.states import TxnState
from tests.handoff.world import finish, make_world, open_transfer, published_bytes_equal, pump_all, reserve_request


class InterruptedLandingLink:
    """Test double of a receiving link: between the landing grant and the byte copy, `meanwhile`
    runs (what other threads do while a real transport copies outside the lock); the copy then
    writes a recognisable pattern, as a late payload would."""

    def __init__(self, frame, raw, meanwhile):
        self.frame, self.raw, self.meanwhile = frame, raw, meanwhile
        self.granted = None

    def recv(self, timeout_s, landing):
        self.granted = landing(self.frame)
        self.meanwhile(self.granted)
        if self.granted is not None:
            for view in chunk_views(self.raw, self.frame.layer, self.granted):
                view[:] = 0xA5
        return self.frame


def _open_a(world):
    request = reserve_request(world, request_id="a", growth=0)
    manifest, src = open_transfer(world, request)
    src.gate.mark_all_ready()
    assert world.endpoint.handle(ManifestFrame(manifest)) == []
    return request, src.begin_send(manifest.chunks[0].chunk_id), src


def test_abort_mid_landing_keeps_blocks_from_the_next_request_and_its_kv_intact():
    world = make_world(num_dst_blocks=12)
    req_a, frame, src_a = _open_a(world)
    seen = {}

    def meanwhile(granted):
        world.endpoint.abort(req_a.transfer_id, RejectReason.CANCELLED)  # the client left mid-copy
        req_b = reserve_request(world, request_id="b", growth=0)
        manifest_b, src_b = open_transfer(world, req_b)
        seen["b"], seen["src_b"] = manifest_b, src_b
        assert not set(granted) & set(manifest_b.dst_blocks), "b was handed blocks a late write still targets"
        pump_all(world, src_b)
        assert published_bytes_equal(world, "b")
        assert world.endpoint.transfers[req_a.transfer_id].writers == 1 and not world.trace.of("quiesced")

    link = InterruptedLandingLink(frame, world.endpoint.raw, meanwhile)
    landed = GrantedLanding(world.endpoint).recv(link, 0.1)
    assert landed is frame and link.granted
    assert published_bytes_equal(world, "b")  # the late copy did not touch b's K/V
    txn = world.endpoint.transfers[req_a.transfer_id]
    assert txn.quiescent and txn.state is TxnState.ABORTED and len(world.trace.of("quiesced")) == 1
    assert world.endpoint.handle(frame) == []  # the late frame itself is fenced
    assert not world.endpoint.blocks.is_reserved(txn.reservation.reservation_id)  # returned once quiet
    finish(world, src_a, seen["src_b"])


def test_a_receive_that_fails_mid_write_still_ends_its_grant():
    world = make_world()
    req_a, frame, src_a = _open_a(world)

    def meanwhile(granted):
        world.endpoint.abort(req_a.transfer_id, RejectReason.TRANSPORT_FAILURE)
        raise ConnectionResetError("link dropped mid-payload")

    with pytest.raises(ConnectionResetError):
        GrantedLanding(world.endpoint).recv(InterruptedLandingLink(frame, world.endpoint.raw, meanwhile), 0.1)
    assert world.endpoint.transfers[req_a.transfer_id].quiescent
    finish(world, src_a)


def test_unaborted_writes_release_nothing_and_stray_ends_are_refused():
    world = make_world()
    req_a, frame, src_a = _open_a(world)
    txn = world.endpoint.transfers[req_a.transfer_id]
    assert world.endpoint.landing_blocks(frame) and txn.writers == 0  # a query grants nothing
    assert world.endpoint.grant_landing(frame) and txn.writers == 1
    world.endpoint.end_landing(req_a.transfer_id)
    assert txn.quiescent and txn.state is TxnState.TRANSFERRING
    with pytest.raises(HandoffError, match="without a grant"):
        world.endpoint.end_landing(req_a.transfer_id)
    world.endpoint.grant_landing(frame)
    with pytest.raises(AssertionError, match="writes still in flight"):
        world.endpoint.abort(req_a.transfer_id, RejectReason.CANCELLED)
        world.endpoint.assert_no_leaks()
    world.endpoint.end_landing(req_a.transfer_id)
    finish(world, src_a)


@pytest.mark.parametrize("kind", ["pull", "tcp"])
def test_a_cancelled_source_aborts_both_ends_and_waits_for_the_peer_to_hang_up(kind):
    """The owner cancels mid-transfer (the producer never finishes): the destination is told,
    aborts and closes its end, and the source sees that close before it may release its blocks."""
    import threading

    from pdserve.handoff.driver import DriveConfig, await_peer_close, drive_source, serve_destination
    from tests.handoff.test_transports import LINKS

    world = make_world(num_tokens=37, credit_bytes=2048, shm=True)
    req = reserve_request(world, num_tokens=37)
    manifest, src = open_transfer(world, req)
    src.gate.mark_ready(0)  # only layer 0 is ever produced: the transfer cannot finish by itself
    sender, receiver = LINKS[kind](world)
    config = DriveConfig(ack_timeout_s=1.0, give_up_s=20.0)

    def destination():
        serve_destination(world.endpoint, receiver, req.transfer_id, config)
        receiver.close()  # what the listener does once the transfer is terminal

    server = threading.Thread(target=destination)
    server.start()
    calls = iter(range(10**9))
    drive_source(src, sender, config, cancelled=lambda: next(calls) > 40)
    assert src.state is TxnState.ABORTED and src.terminal_reason is RejectReason.CANCELLED
    assert await_peer_close(sender, 10.0)
    server.join(10)
    sender.close()
    assert not server.is_alive()
    txn = world.endpoint.transfers[req.transfer_id]
    assert txn.state is TxnState.ABORTED and txn.quiescent
    finish(world, src)
