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
