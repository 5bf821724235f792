"""The producer gate with chunked prefill: a layer's early blocks stream while later chunks compute."""

from __future__ import annotations

import threading

import pytest

from pdserve.handoff.errors import HandoffError, RejectReason as R
from pdserve.handoff.frames import ManifestFrame
from pdserve.handoff.gate import LayerGate
from pdserve.handoff.states import TxnState
from tests.handoff.world import ABI, deliver, finish, make_world, open_transfer, published_bytes_equal, pump_chunk, reserve_request


@pytest.fixture
def world():
    w = make_world(num_tokens=22)
    yield w
    w.close()


def test_gate_watermarks():
    gate = LayerGate(3)
    assert not gate.covers(0, 1) and gate.covers(0, 0)
    v0 = gate.version
    gate.mark_progress(0, 8)
    assert gate.covers(0, 8) and not gate.covers(0, 9) and not gate.covers(1, 1)
    assert gate.version == v0 + 1 and not gate.is_ready(0) and not gate.all_ready()
    with pytest.raises(ValueError, match="moved back"):
        gate.mark_progress(0, 4)
    with pytest.raises(ValueError, match="out of range"):
        gate.mark_progress(3, 4)
    gate.mark_ready(1, ts=5.0)
    assert gate.covers(1, 10**9) and gate.is_ready(1) and gate.ready_times() == {1: 5.0}
    gate.mark_all_ready()
    assert gate.all_ready()


def test_gate_wakes_waiter_on_progress():
    gate = LayerGate(2)
    seen = gate.version
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(gate.wait_for_more(seen, 5.0)))
    waiter.start()
    gate.mark_progress(1, 4)
    waiter.join(5.0)
    assert woke == [True]
    assert gate.wait_for_more(gate.version, 0.01) is False


def test_only_covered_chunks_with_known_blocks_are_sendable(world):
    """22 tokens in blocks of 4 -> 6 blocks, chunks of 2 blocks (8 tokens) per layer."""
    req = reserve_request(world)
    gate = LayerGate(ABI.num_layers)
    full_blocks = list(world.src_blocks)
    world.src_blocks = full_blocks[:2]  # chunked prefill has allocated the first chunk's blocks only
    manifest, src = open_transfer(world, req, blocks_per_chunk=2, gate=gate)
    assert src.ready_chunks() == []
    gate.mark_progress(0, 8)
    assert [c.chunk_id for c in src.ready_chunks()] == ["L0:0+2"]
    gate.mark_progress(0, 16)  # tokens covered, but blocks 2..3 are not known yet
    assert [c.chunk_id for c in src.ready_chunks()] == ["L0:0+2"]
    with pytest.raises(HandoffError) as err:
        src.begin_send("L0:2+2")
    assert err.value.reason is R.PRODUCER_NOT_READY and world.credits.in_flight == 0
    src.set_src_blocks(full_blocks[:4])
    assert [c.chunk_id for c in src.ready_chunks()] == ["L0:0+2", "L0:2+2"]
    with pytest.raises(HandoffError) as err:
        src.set_src_blocks(full_blocks + [99])
    assert err.value.reason is R.INCOMPLETE_COVERAGE
    finish(world, src)


def test_progressive_transfer_publishes_exact_bytes(world):
    """Interleave prefill progress with sends as a chunked prefill would; the last chunk (a partial
    block) is sendable only once the layer is complete."""
    req = reserve_request(world)
    gate = LayerGate(ABI.num_layers)
    full_blocks = list(world.src_blocks)
    manifest, src = open_transfer(world, req, blocks_per_chunk=2, gate=gate)
    src.set_src_blocks([])
    deliver(src, world.endpoint.handle(ManifestFrame(manifest)))
    sent: list[str] = []
    for end in (8, 16, 22):
        src.set_src_blocks(full_blocks[: -(-end // ABI.block_size)])
        for layer in range(ABI.num_layers):
            if end == 22:
                gate.mark_ready(layer)
            else:
                gate.mark_progress(layer, end)
            for spec in src.ready_chunks():
                assert spec.token_start + spec.token_count <= end
                pump_chunk(world, src, spec.chunk_id)
                sent.append(spec.chunk_id)
        if end < 22:
            assert "L0:4+2" not in sent  # holds the partial last block: needs the complete layer
    assert len(sent) == len(manifest.chunks) and src.all_sent()
    deliver(src, world.endpoint.handle(src.seal()))
    assert src.state is TxnState.PUBLISHED
    world.src_blocks = full_blocks
    assert published_bytes_equal(world, req.request_id)
    finish(world, src)
