"""Check: one K/V transfer transaction from reservation to source acknowledgement (0x06A-0x06E).

Fences, in order: identity and tensor ABI equal the expected manifest; every chunk carries the
transaction's transfer id and generation; the chunk set, byte sizes, checksums and per-layer
token coverage match the manifest; no chunk is sent before its layer is produced; each chunk's
credit is acquired before send and returned exactly at DEVICE_VISIBLE; bytes holding credit
never exceed the window; validation follows the last visibility, then exactly one publication,
then decode admission, then the source acknowledgement.
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger.checks.common import (
    expect_equal,
    get,
    integer,
    number,
    require,
    require_order,
    require_synthetic,
)
from pdserve.ledger.kv import kv_bytes_per_layer_token
from pdserve.ledger.transfer import CreditHold, peak_inflight_bytes

IDENTITY = ("tenant", "request", "generation", "attempt", "source_epoch", "destination_epoch", "reservation")
STATES = ["PLANNED", "RESERVED", "TRANSFERRING", "VALIDATED", "PUBLISHED"]
CHUNK_TIMES = ("credit_acquire_ms", "send_ms", "receive_ms", "device_visible_ms")
CREDIT_RELEASE_EVENT = "DEVICE_VISIBLE"


def _check_identity(fx: dict) -> None:
    for name in IDENTITY:
        expect_equal(f"identity.{name}", get(fx, f"transaction.identity.{name}"), get(fx, f"manifest.identity.{name}"))
    for name in ("transfer_id", "tensor_abi_hash"):
        expect_equal(name, get(fx, f"transaction.{name}"), get(fx, f"manifest.{name}"))


def _check_chunk_fences(fx: dict, chunks: list[dict]) -> None:
    transfer_id, generation = get(fx, "manifest.transfer_id"), get(fx, "manifest.identity.generation")
    for chunk in chunks:
        cid = chunk.get("chunk_id")
        expect_equal(f"chunk {cid} transfer_id", chunk.get("transfer_id"), transfer_id)
        expect_equal(f"chunk {cid} generation", chunk.get("generation"), generation)


def _check_manifest_coverage(fx: dict, chunks: list[dict]) -> int:
    layers, tokens = integer(fx, "manifest.layers", 1), integer(fx, "manifest.tokens", 1)
    checksums = get(fx, "manifest.checksums", dict)
    ids = [c.get("chunk_id") for c in chunks]
    require(len(set(ids)) == len(ids), f"duplicate chunk ids in {ids}")
    expect_equal("chunk id set", sorted(ids), sorted(checksums))
    expect_equal("chunk count", len(chunks), layers * integer(fx, "manifest.chunks_per_layer", 1))
    per_token = kv_bytes_per_layer_token(
        integer(fx, "manifest.kv_heads", 1), integer(fx, "manifest.head_dim", 1), integer(fx, "manifest.dtype_bytes", 1)
    )
    for chunk in chunks:
        cid = chunk["chunk_id"]
        require(0 <= chunk.get("layer", -1) < layers, f"chunk {cid} names layer {chunk.get('layer')} outside 0..{layers - 1}")
        expect_equal(f"chunk {cid} bytes", chunk.get("bytes"), chunk.get("token_count", 0) * per_token)
        expect_equal(f"chunk {cid} bytes vs manifest chunk size", chunk["bytes"], get(fx, "manifest.chunk_bytes"))
        expect_equal(f"chunk {cid} checksum", chunk.get("checksum"), checksums[cid])
    for layer in range(layers):
        _check_layer_coverage(layer, [c for c in chunks if c["layer"] == layer], tokens)
    return sum(c["bytes"] for c in chunks)


def _check_layer_coverage(layer: int, chunks: list[dict], tokens: int) -> None:
    cursor = 0
    for chunk in sorted(chunks, key=lambda c: c.get("token_start", 0)):
        start = chunk.get("token_start")
        require(start == cursor, f"layer {layer} coverage: chunk {chunk['chunk_id']} starts at token {start}, expected {cursor}")
        cursor = start + chunk["token_count"]
    require(cursor == tokens, f"layer {layer} coverage ends at token {cursor}, expected {tokens}")


def _check_chunk_timing(fx: dict, chunks: list[dict]) -> int:
    ready = get(fx, "transaction.layer_ready_ms", list)
    expect_equal("layer_ready_ms entries", len(ready), get(fx, "manifest.layers"))
    expect_equal("credit release event", get(fx, "transaction.credit_release_event"), CREDIT_RELEASE_EVENT)
    for chunk in chunks:
        cid = chunk["chunk_id"]
        require(chunk["send_ms"] >= ready[chunk["layer"]], f"producer gate: chunk {cid} sent at {chunk['send_ms']} before layer {chunk['layer']} ready at {ready[chunk['layer']]}")
        require_order(f"chunk {cid}", [(name, chunk[name]) for name in CHUNK_TIMES])
        expect_equal(f"chunk {cid} credit release", chunk.get("credit_release_ms"), chunk["device_visible_ms"])
    holds = [CreditHold(c["credit_acquire_ms"], c["credit_release_ms"], c["bytes"]) for c in chunks]
    peak = peak_inflight_bytes(holds)
    window = integer(fx, "manifest.credit_window_bytes", 1)
    require(peak <= window, f"byte credits: {peak} bytes in flight exceed the {window}-byte window")
    return peak


def _check_commit_order(fx: dict, chunks: list[dict]) -> dict[str, float]:
    expect_equal("state path", get(fx, "transaction.states", list), STATES)
    expect_equal("publications", get(fx, "transaction.publications"), 1)
    last_visible = max(c["device_visible_ms"] for c in chunks)
    steps = [("last device-visible chunk", last_visible)] + [
        (name, number(fx, f"transaction.{name}")) for name in ("validate_ms", "publish_ms", "decode_admit_ms", "source_ack_ms")
    ]
    require_order("commit order", steps)
    return {"all_visible_ms": last_visible, "validate_ms": steps[1][1], "publish_ms": steps[2][1]}


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    _check_identity(fx)
    chunks = get(fx, "transaction.chunks", list)
    require(bool(chunks), "transaction has no chunks")
    _check_chunk_fences(fx, chunks)
    total = _check_manifest_coverage(fx, chunks)
    require(total <= integer(fx, "manifest.reservation_bytes", 1), f"{total} bytes exceed the destination reservation")
    peak = _check_chunk_timing(fx, chunks)
    derived = {
        "chunks": len(chunks),
        "total_bytes": total,
        "peak_inflight_bytes": peak,
        "last_producer_ready_ms": max(get(fx, "transaction.layer_ready_ms")),
        **_check_commit_order(fx, chunks),
    }
    for key, value in derived.items():
        expect_equal(key, value, get(fx, f"expected.{key}"))
    return derived
