"""Sets and byte ledgers as the handoff uses them (the `pdserve.ledger` copy), schedules, state
machines and the trace sink."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.handoff.errors import HandoffError, RejectReason as R
from pdserve.handoff.transports.base import TrafficCounter
from pdserve.handoff.states import ChunkState, ChunkTable, TxnState, check_txn_move
from pdserve.handoff.streaming import (choose_schedule, exposed_transfer_s, layerwise_visible_times,
                                       serialized_completion)
from pdserve.handoff.trace import TraceSink, read_trace
from pdserve.ledger import PhysicalTraffic, handoff_sets, logical_transfer_bytes

PROMPT = [f"b{i}" for i in range(8)]


def test_compute_and_transfer_sets_differ():
    sets = handoff_sets(PROMPT, ["b0", "b1", "b2"], ["b0"])
    assert sets.compute_blocks == ("b3", "b4", "b5", "b6", "b7")
    assert sets.transfer_blocks == ("b1", "b2", "b3", "b4", "b5", "b6", "b7")


def test_source_hit_never_warms_destination():
    assert handoff_sets(PROMPT, PROMPT, []).transfer_blocks == tuple(PROMPT)
    assert len(handoff_sets(PROMPT, [], ["b0", "b1"]).transfer_blocks) == 6


def test_logical_bytes_follow_transfer_set():
    abi = KvAbi(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert abi.bytes_per_token == 131072
    geometry = (abi.block_size, abi.num_layers, abi.num_kv_heads, abi.head_dim, abi.dtype_bytes)
    assert logical_transfer_bytes(7, *geometry) == 7 * 16 * 131072 == 7 * abi.bytes_per_block


def test_physical_ledger_is_separate():
    ledger = PhysicalTraffic().add(payload_bytes=100, header_bytes=10).add(retry_bytes=100, num_retries=1)
    assert ledger.total_bytes == 210 and ledger.payload_bytes == 100
    counter = TrafficCounter()
    counter.record(payload_bytes=100, num_frames=1)
    counter.record(header_bytes=10)
    assert counter.snapshot == PhysicalTraffic(payload_bytes=100, header_bytes=10, num_frames=1)


def test_layerwise_recurrence_and_exposed_time():
    ready = [0.025, 0.050, 0.075, 0.100]
    visible = layerwise_visible_times(ready, [0.010] * 4)
    assert visible == pytest.approx([0.035, 0.060, 0.085, 0.110])
    assert serialized_completion(ready, [0.010] * 4) == pytest.approx(0.140)
    assert exposed_transfer_s(visible[-1], ready[-1]) == pytest.approx(0.010)
    assert exposed_transfer_s(0.05, 0.1) == 0.0


def test_schedule_choice_by_prompt_size():
    assert choose_schedule(100) == "serialized" and choose_schedule(4096) == "layerwise"


@pytest.mark.parametrize("old,new,reason", [
    (TxnState.PLANNED, TxnState.TRANSFERRING, R.ILLEGAL_TRANSITION),
    (TxnState.RESERVED, TxnState.PUBLISHED, R.ILLEGAL_TRANSITION),
    (TxnState.PUBLISHED, TxnState.ABORTED, R.ALREADY_PUBLISHED),
    (TxnState.ABORTED, TxnState.PUBLISHED, R.TXN_ABORTED),
])
def test_illegal_txn_moves(old, new, reason):
    with pytest.raises(HandoffError) as err:
        check_txn_move(old, new)
    assert err.value.reason is reason


def test_chunk_state_machine():
    table = ChunkTable(["c"])
    with pytest.raises(HandoffError):
        table.move("c", ChunkState.SENT)
    table.advance_to("c", ChunkState.RECEIVED)
    with pytest.raises(HandoffError):
        table.move("c", ChunkState.SENT)
    table.move("c", ChunkState.DEVICE_VISIBLE)
    assert table.cancel_open() == []


def test_trace_sink_writes_schema(tmp_path):
    path = tmp_path / "trace.jsonl"
    sink = TraceSink(str(path))
    sink.emit("chunk_send", "r", "x", 3, 1, layer=2, chunk="L2:0+4", bytes=10, worker="p0")
    with pytest.raises(ValueError):
        sink.emit("bogus", "r", "x", 3, 1)
    sink.close()
    line = json.loads(path.read_text().splitlines()[0])
    assert set(line) == {"ts", "event", "request", "transfer", "generation", "attempt", "layer", "chunk", "bytes",
                         "reason", "worker", "tokens"}
    assert read_trace(str(path))[0].chunk == "L2:0+4"
