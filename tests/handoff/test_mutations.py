"""Mutation suite: each test changes exactly one field or step of a correct transfer and checks that
the right fence refuses it with a specific reason, and that no block or credit leaks afterwards."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.handoff.errors import HandoffError, RejectReason as R
from pdserve.handoff.frames import ManifestFrame
from pdserve.handoff.states import ChunkState, ChunkTable, TxnState
from pdserve.handoff.validate import validate_landing

from tests.handoff.world import (ABI, IDENTITY, deliver, finish, make_world, open_transfer, pump_all, pump_chunk,
                                 published_bytes_equal, reserve_request)

replace = msgspec.structs.replace


@pytest.fixture
def world():
    return make_world()


def _rejections(world):
    return [e.reason for e in world.trace.of("reject")]


def _open_with(world, **manifest_changes):
    """Send a manifest with one change; return the refusal reason recorded by the endpoint."""
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    world.endpoint.handle(ManifestFrame(replace(manifest, **manifest_changes)))
    return src


FENCE_CASES = [
    ("tenant", "tenant-b", R.WRONG_TENANT),
    ("request_id", "req-other", R.WRONG_REQUEST),
    ("generation", 9, R.WRONG_GENERATION),
    ("attempt", 4, R.WRONG_ATTEMPT),
    ("source_epoch", 2, R.WRONG_SOURCE_EPOCH),
    ("destination_epoch", 6, R.WRONG_DESTINATION_EPOCH),
    ("reservation_id", "dst-r99", R.WRONG_RESERVATION),
]


@pytest.mark.parametrize("field,value,reason", FENCE_CASES)
def test_manifest_fence_field(world, field, value, reason):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    answers = world.endpoint.handle(ManifestFrame(replace(manifest, fence=replace(manifest.fence, **{field: value}))))
    assert answers and answers[0].published is False and answers[0].reason == reason.value
    assert world.endpoint.transfers[req.transfer_id].state is TxnState.ABORTED
    deliver(src, answers)
    assert src.state is TxnState.ABORTED
    finish(world, src)


@pytest.mark.parametrize("field,value,reason", FENCE_CASES)
def test_chunk_frame_fence_field(world, field, value, reason):
    """A frame from another attempt/epoch/reservation is fenced: dropped, never landed."""
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    world.endpoint.handle(ManifestFrame(manifest))
    first = manifest.chunks[0].chunk_id
    answers = pump_chunk(world, src, first, mutate=lambda f: replace(f, fence=replace(f.fence, **{field: value})))
    assert answers == [] and _rejections(world) == [reason]
    assert world.endpoint.transfers[req.transfer_id].table.state(first) is ChunkState.DECLARED
    finish(world, src)


@pytest.mark.parametrize("change,reason", [
    ({"abi_hash": KvAbi(3, 2, 8, 8, "bfloat16").abi_hash}, R.WRONG_ABI),
    ({"model_hash": "m-2"}, R.WRONG_MODEL),
    ({"tokenizer_hash": "t-2"}, R.WRONG_TOKENIZER),
    ({"adapter": "lora-x"}, R.WRONG_ADAPTER),
    ({"position_policy": "alibi"}, R.WRONG_POSITION_POLICY),
])
def test_model_identity_field(world, change, reason):
    src = _open_with(world, identity=replace_identity(**change))
    assert _rejections(world) == [reason]
    finish(world, src)


def replace_identity(**change):
    from dataclasses import replace as dc_replace
    return dc_replace(IDENTITY, **change)


def test_wrong_prompt_digest(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    world.endpoint.handle(ManifestFrame(replace(manifest, prompt=replace(manifest.prompt, digest="digest-x"))))
    assert _rejections(world) == [R.WRONG_PROMPT]
    finish(world, src)


def test_missing_chunk(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    skipped = manifest.chunks[-1].chunk_id
    pump_all(world, src, seal=False, skip={skipped})
    src.checksums[skipped] = 0  # pretend it was sent so a seal can be built
    src.table.advance_to(skipped, ChunkState.SENT)
    world.endpoint.handle(src.seal())
    txn = world.endpoint.transfers[req.transfer_id]
    with pytest.raises(HandoffError) as err:
        txn.validate()
    assert err.value.reason is R.MISSING_CHUNK and txn.state is TxnState.TRANSFERRING
    finish(world, src)


def test_extra_chunk_frame_aborts(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    world.endpoint.handle(ManifestFrame(manifest))
    answers = pump_chunk(world, src, manifest.chunks[0].chunk_id, mutate=lambda f: replace(f, chunk_id="L9:0+2"))
    assert answers[-1].reason == R.UNKNOWN_CHUNK.value and src.state is TxnState.ABORTED
    finish(world, src)


def test_extra_chunk_in_seal(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    seal = src.seal()
    answers = world.endpoint.handle(replace(seal, checksums={**seal.checksums, "L9:0+2": 1}))
    assert answers[-1].reason == R.UNKNOWN_CHUNK.value
    assert world.endpoint.transfers[req.transfer_id].state is TxnState.ABORTED
    deliver(src, answers)
    finish(world, src)


def test_duplicate_chunk_with_other_bytes_is_corruption(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    first = manifest.chunks[0].chunk_id
    dup = replace(_frame_for(src, first), checksum=12345)
    answers = world.endpoint.handle(dup)
    assert answers[-1].reason == R.CHUNK_CONFLICT.value
    assert world.endpoint.transfers[req.transfer_id].state is TxnState.ABORTED
    deliver(src, answers)
    finish(world, src)


def _frame_for(src, chunk_id):
    from pdserve.handoff.frames import ChunkFrame
    spec = src.manifest.chunk(chunk_id)
    return ChunkFrame(src.manifest.transfer_id, src.manifest.fence, chunk_id, spec.layer, spec.nbytes, src.checksums[chunk_id])


def test_duplicate_chunk_with_same_bytes_is_idempotent(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    answers = world.endpoint.handle(_frame_for(src, manifest.chunks[0].chunk_id))
    assert answers[0].visible and not _rejections(world)
    deliver(src, world.endpoint.handle(src.seal()))
    assert src.state is TxnState.PUBLISHED and published_bytes_equal(world, "req-1")
    finish(world, src)


def test_bad_checksum_is_refused_and_retried(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    world.endpoint.handle(ManifestFrame(manifest))
    first = manifest.chunks[0].chunk_id
    answers = pump_chunk(world, src, first, mutate=lambda f: replace(f, checksum=f.checksum ^ 1))
    assert answers[0].visible is False and answers[0].reason == R.BAD_CHECKSUM.value
    assert src.resend_queue == [first] and world.credits.holds(f"{req.transfer_id}/{first}")
    finish(world, src)


def test_bad_size(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    world.endpoint.handle(ManifestFrame(manifest))
    answers = pump_chunk(world, src, manifest.chunks[0].chunk_id, mutate=lambda f: replace(f, nbytes=f.nbytes - 2))
    assert answers[0].reason == R.BAD_SIZE.value
    finish(world, src)


def test_send_before_producer_ready(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_ready(0)
    late = next(c for c in manifest.chunks if c.layer == 1)
    with pytest.raises(HandoffError) as err:
        src.begin_send(late.chunk_id)
    assert err.value.reason is R.PRODUCER_NOT_READY and world.credits.in_flight == 0
    assert all(c.layer == 0 for c in src.ready_chunks())
    finish(world, src)


def test_publish_before_validation_is_illegal(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    pump_all(world, src, seal=False, skip={manifest.chunks[-1].chunk_id})
    txn = world.endpoint.transfers[req.transfer_id]
    with pytest.raises(HandoffError) as err:
        txn.publish(world.endpoint.directory)
    assert err.value.reason is R.ILLEGAL_TRANSITION and world.endpoint.directory.lookup("req-1") is None
    finish(world, src)


def test_publish_before_all_visible_fails_validation():
    world = make_world()
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    table = ChunkTable([c.chunk_id for c in manifest.chunks])
    sums = {c.chunk_id: 1 for c in manifest.chunks}
    for c in manifest.chunks:
        table.advance_to(c.chunk_id, ChunkState.DEVICE_VISIBLE if c is not manifest.chunks[-1] else ChunkState.RECEIVED)
    with pytest.raises(HandoffError) as err:
        validate_landing(manifest, manifest.fence, sums, dict(sums), table)
    assert err.value.reason is R.NOT_VISIBLE
    finish(world, src)


def test_unsealed_transfer_does_not_publish(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    with pytest.raises(HandoffError) as err:
        world.endpoint.transfers[req.transfer_id].validate()
    assert err.value.reason is R.NOT_SEALED
    finish(world, src)


def test_incomplete_layer_coverage(world):
    """A manifest missing one layer x block range never validates, even if every listed chunk lands."""
    from pdserve.handoff.source import SourceTransfer
    req = reserve_request(world)
    manifest, full_src = open_transfer(world, req)
    short = replace(manifest, chunks=manifest.chunks[:-1])
    src = SourceTransfer(short, full_src.raw, full_src.src_blocks, world.credits, full_src.gate, world.trace)
    answers = pump_all(world, src)
    assert answers[-1].reason == R.INCOMPLETE_COVERAGE.value and src.state is TxnState.ABORTED
    assert world.endpoint.directory.lookup("req-1") is None
    finish(world, src)


def test_credit_overrun(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    with pytest.raises(HandoffError) as err:
        world.credits.acquire("x", world.credits.capacity_bytes + 1)
    assert err.value.reason is R.CREDIT_OVERRUN
    world.credits.acquire("a", world.credits.capacity_bytes)
    with pytest.raises(HandoffError) as err:
        world.credits.acquire("b", 1)
    assert err.value.reason is R.CREDIT_OVERRUN and world.credits.in_flight == world.credits.capacity_bytes
    world.credits.release("a", ChunkState.DEVICE_VISIBLE)
    finish(world, src)


def test_credit_ranges_never_overlap_and_are_reused_first_fit():
    """A credit is a range of the window (= the shm staging area): held ranges are disjoint."""
    from pdserve.handoff.credits import ByteCredits

    credits = ByteCredits(1000)
    assert [credits.acquire(k, 300) for k in "abc"] == [0, 300, 600]
    assert not credits.can_acquire(101) and credits.can_acquire(100)
    credits.release("b", ChunkState.DEVICE_VISIBLE)
    assert not credits.can_acquire(401)  # 400 bytes free in total, but only 300 of them contiguous
    assert credits.acquire("d", 250) == 300 and credits.offset_of("d") == 300
    assert credits.acquire("e", 100) == 900
    for key in "acde":
        credits.reclaim(key)
    credits.assert_no_leaks()


def test_credit_returned_at_receive_is_refused(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    cid = manifest.chunks[0].chunk_id
    src.begin_send(cid)
    with pytest.raises(HandoffError) as err:
        world.credits.release(f"{req.transfer_id}/{cid}", ChunkState.RECEIVED)
    assert err.value.reason is R.CREDIT_EARLY_RETURN and world.credits.in_flight == manifest.chunks[0].nbytes
    finish(world, src)


def test_returning_credits_never_frees_reserved_blocks(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    free_before = world.blocks.num_free
    pump_all(world, src, seal=False)
    assert world.credits.in_flight == 0 and world.blocks.num_free == free_before
    finish(world, src)


def test_stale_completion_after_reroute(world):
    old_req = reserve_request(world, generation=1)
    _, old_src = open_transfer(world, old_req)
    new_req = reserve_request(world, generation=2, attempt=1)
    _, new_src = open_transfer(world, new_req)
    pump_all(world, new_src)
    assert new_src.state is TxnState.PUBLISHED
    answers = pump_all(world, old_src)
    assert answers[-1].reason == R.STALE_GENERATION.value and old_src.state is TxnState.ABORTED
    assert world.endpoint.directory.lookup("req-1").transfer_id == new_req.transfer_id
    finish(world, old_src, new_src)


def test_late_frames_after_supersede_are_fenced(world):
    old_req = reserve_request(world, generation=1)
    old_manifest, old_src = open_transfer(world, old_req)
    old_src.gate.mark_all_ready()
    world.endpoint.handle(ManifestFrame(old_manifest))
    assert world.endpoint.supersede("req-1", 2) == [old_req.transfer_id]
    answers = pump_chunk(world, old_src, old_manifest.chunks[0].chunk_id)
    assert answers == [] and _rejections(world) == [R.TXN_ABORTED]
    finish(world, old_src)


def test_publish_after_abort(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    world.endpoint.abort(req.transfer_id, R.CANCELLED)
    answers = world.endpoint.handle(src.seal())
    assert answers == [] and _rejections(world) == [R.TXN_ABORTED]
    with pytest.raises(HandoffError) as err:
        world.endpoint.transfers[req.transfer_id].publish(world.endpoint.directory)
    assert err.value.reason is R.TXN_ABORTED and world.endpoint.directory.lookup("req-1") is None
    finish(world, src)


def test_second_owner_at_same_generation_is_refused(world):
    first_req = reserve_request(world)
    _, first = open_transfer(world, first_req)
    second_req = reserve_request(world)
    _, second = open_transfer(world, second_req)
    pump_all(world, first)
    answers = pump_all(world, second)
    assert answers[-1].reason == R.STALE_GENERATION.value
    assert world.endpoint.directory.owners() == {"req-1": first_req.transfer_id}
    finish(world, first, second)


def test_repeated_publication_of_same_transfer_is_idempotent(world):
    req = reserve_request(world)
    _, src = open_transfer(world, req)
    pump_all(world, src)
    again = world.endpoint.handle(src.seal())
    assert again[0].published and world.endpoint.directory.owners() == {"req-1": req.transfer_id}
    finish(world, src)


def test_source_release_before_publish(world):
    req = reserve_request(world)
    _, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    with pytest.raises(HandoffError) as err:
        src.release_source()
    assert err.value.reason is R.RELEASE_BEFORE_PUBLISH and not src.released
    finish(world, src)


def test_abort_after_publish_is_refused(world):
    req = reserve_request(world)
    _, src = open_transfer(world, req)
    pump_all(world, src)
    with pytest.raises(HandoffError) as err:
        world.endpoint.transfers[req.transfer_id].abort(R.CANCELLED, world.blocks)
    assert err.value.reason is R.ALREADY_PUBLISHED
    with pytest.raises(HandoffError) as err:
        src.abort(R.CANCELLED)
    assert err.value.reason is R.ALREADY_PUBLISHED
    finish(world, src)


def test_decode_admits_only_published(world):
    req = reserve_request(world)
    _, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    with pytest.raises(HandoffError) as err:
        world.endpoint.admit("req-1")
    assert err.value.reason is R.NOT_PUBLISHED
    finish(world, src)


def test_source_epoch_bump_fences_open_transfers(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    world.endpoint.handle(ManifestFrame(manifest))
    pump_chunk(world, src, manifest.chunks[0].chunk_id)
    assert world.endpoint.fence_source("prefill-0", 4) == [req.transfer_id]
    txn = world.endpoint.transfers[req.transfer_id]
    assert txn.terminal_reason is R.WRONG_SOURCE_EPOCH
    assert pump_chunk(world, src, manifest.chunks[1].chunk_id) == []
    finish(world, src)


def test_answer_from_other_generation_is_ignored_by_source(world):
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    pump_all(world, src, seal=False)
    from pdserve.handoff.frames import PublishAck
    with pytest.raises(HandoffError) as err:
        src.on_publish_ack(PublishAck(req.transfer_id, 5, "req-1", True))
    assert err.value.reason is R.WRONG_GENERATION and src.state is TxnState.TRANSFERRING
    finish(world, src)


def test_happy_path_is_bitwise_exact_and_traced(world):
    req = reserve_request(world)
    _, src = open_transfer(world, req)
    pump_all(world, src)
    assert src.state is TxnState.PUBLISHED and published_bytes_equal(world, "req-1")
    events = {e.event for e in world.trace.events}
    assert {"reserve", "chunk_send", "chunk_receive", "chunk_visible", "validate", "publish", "ack"} <= events
    assert all(e.request == "req-1" and e.transfer == req.transfer_id and e.generation == 1 for e in world.trace.events)
    world.endpoint.admit("req-1")
    src.release_source()
    finish(world, src)
