"""A destination's transfer records are released, not kept for the worker's life.

`DecodeEndpoint.release` drops a record only once nothing can still read it: the transfer is
terminal, no landing write is in flight, no receiving link carries it, and no published handle in
the directory names it. Until then the record (a tombstone, for late frames) stays, and a later
`release` or `retire` drops it. A released transfer can never be claimed by a link again.
"""

from __future__ import annotations

from pdserve.handoff.endpoint import GrantedLanding
from pdserve.handoff.errors import RejectReason
from pdserve.handoff.frames import ManifestFrame
from pdserve.handoff.states import TxnState
from tests.handoff.world import finish, make_world, open_transfer, pump_all, reserve_request


def test_an_unfinished_transfer_is_kept_and_an_aborted_one_without_link_goes_at_once():
    world = make_world()
    request = reserve_request(world, request_id="a", growth=0)
    manifest, src = open_transfer(world, request)
    assert not world.endpoint.release(request.transfer_id)  # reserved, not finished: kept
    assert request.transfer_id in world.endpoint.transfers
    world.endpoint.abort(request.transfer_id, RejectReason.CANCELLED)
    assert world.endpoint.release(request.transfer_id)
    assert request.transfer_id not in world.endpoint.transfers
    assert not world.endpoint.claim(request.transfer_id)  # a late link naming it is refused
    finish(world, src)


def test_a_published_transfer_stays_until_its_handle_is_retired():
    world = make_world()
    request = reserve_request(world, request_id="p", growth=0)
    manifest, src = open_transfer(world, request)
    pump_all(world, src)
    assert world.endpoint.transfers[request.transfer_id].state is TxnState.PUBLISHED
    assert not world.endpoint.release(request.transfer_id)  # the directory's handle names it
    world.endpoint.admit("p")
    world.endpoint.retire("p")  # decode is done: the handle goes, and so does the record
    assert request.transfer_id not in world.endpoint.transfers
    finish(world, src)


def test_a_record_a_link_carries_or_writes_into_is_kept_until_both_end():
    world = make_world(num_dst_blocks=12)
    request = reserve_request(world, request_id="w", growth=0)
    manifest, src = open_transfer(world, request)
    src.gate.mark_all_ready()
    assert world.endpoint.claim(request.transfer_id)
    assert not world.endpoint.claim(request.transfer_id)  # one link per transfer
    world.endpoint.handle(ManifestFrame(manifest))
    frame = src.begin_send(manifest.chunks[0].chunk_id)
    landing = GrantedLanding(world.endpoint)
    assert landing(frame)  # a write is granted and not yet ended
    world.endpoint.abort(request.transfer_id, RejectReason.CANCELLED)
    assert not world.endpoint.release(request.transfer_id)  # a write is in flight
    world.endpoint.end_landing(request.transfer_id)
    assert not world.endpoint.release(request.transfer_id)  # quiescent, but the link still holds it
    world.endpoint.unclaim(request.transfer_id)
    assert world.endpoint.release(request.transfer_id)
    assert world.endpoint.transfers == {}
    assert world.endpoint.handle(frame) == []  # a late frame for it is refused, not answered
    finish(world, src)


def test_a_published_transfer_displaced_by_a_newer_generation_goes_with_its_handle():
    world = make_world()
    old = reserve_request(world, request_id="d", generation=1, growth=0)
    _, src_old = open_transfer(world, old)
    pump_all(world, src_old)
    assert not world.endpoint.release(old.transfer_id)  # its handle is the request's published one
    new = reserve_request(world, request_id="d", generation=2, growth=0)
    _, src_new = open_transfer(world, new)
    pump_all(world, src_new)  # the newer generation's publication displaces the older handle
    assert old.transfer_id not in world.endpoint.transfers and new.transfer_id in world.endpoint.transfers
    world.endpoint.admit("d")
    world.endpoint.retire("d")
    assert world.endpoint.transfers == {}
    finish(world, src_old, src_new)
