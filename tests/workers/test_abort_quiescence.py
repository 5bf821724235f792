"""`Worker.abort` (the entry point of every abort trigger: the router's Abort on a client
disconnect, reroute, recompute, lease expiry, role change) while a landing write is in flight.

A source (this test, on a real TCP socket into the decode worker's real listener) sends a
manifest and the first bytes of a chunk's payload, then stalls: the listener holds a landing grant on the
reservation's blocks. The router's Abort arrives. The blocks must not go back to the engine
until the grant ended, so the next reservation cannot get them, and bytes that land late never
reach another request's K/V: the next request decodes exactly what one engine computes.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.frames import ChunkFrame, ManifestFrame, encode_frame
from pdserve.handoff.kvbytes import checksum_views
from pdserve.handoff.states import TxnState
from pdserve.handoff.transports.channels import _LEN
from pdserve.workers import messages as m
from pdserve.workers.worker import Worker, WorkerConfig

# six blocks: request a holds four (and one of growth), so b fits only in blocks a gives back
ENGINE = EngineConfig(model="tiny", dtype="float32", num_blocks=6, max_num_batched_tokens=64, num_threads=1)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT_A = tuple((i * 7919 + 13) % 250 + 3 for i in range(64))
PROMPT_B = tuple((i * 104729 + 7) % 250 + 3 for i in range(64))
STALL_AFTER_BYTES = 16  # the source stops 16 bytes into chunk 0: every later byte of it lands late


@pytest.fixture
def workers():
    torch.set_num_threads(1)
    p0, d0 = (Worker(WorkerConfig(wid, role, "tcp://127.0.0.1:9", engine=ENGINE)) for wid, role in (("p0", "prefill"), ("d0", "decode")))
    sent = {"p0": [], "d0": []}
    p0.send, d0.send = sent["p0"].append, sent["d0"].append
    yield p0, d0, sent
    for w in (p0, d0):
        w.close()


def _until(cond, what: str, timeout_s: float = 60.0, pump=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        for w in pump:
            w.drain_events()
            if w.engine.has_unfinished():
                w.step()
        time.sleep(0.002)


def _reserve(d0: Worker, sent, rid: str, prompt) -> m.Reserved:
    d0.handle(m.ReserveKv(rid, f"{rid}/g1", 1, prompt, PARAMS, "p0", 1))
    return [x for x in sent["d0"] if isinstance(x, m.Reserved)][-1]


def _plan(at: m.Reserved, d0: Worker) -> m.TransferPlan:
    return m.TransferPlan(at.transfer_id, 1, m.FIRST_ATTEMPT, "default", "d0", 1, at.reservation_id, at.dest_blocks,
                          at.num_visible_blocks, "tcp", d0.decode.address)


def _stall_mid_payload(p0: Worker, d0: Worker, at: m.Reserved) -> tuple[socket.socket, bytes]:
    """Open a's link, send its manifest and the first bytes of chunk 0; returns the socket and the rest."""
    manifest = p0.prefill.sender.manifest_for("a", PROMPT_A, _plan(at, d0), "default", "serialized")
    spec = manifest.chunks[0]
    header = encode_frame(ChunkFrame(at.transfer_id, manifest.fence, spec.chunk_id, spec.layer, spec.nbytes, 0))
    payload = bytes([0x5A]) * spec.nbytes  # not K/V anyone computed: it must never be read by a request
    sock = socket.create_connection(d0.decode.address)
    manifest_header = encode_frame(ManifestFrame(manifest))
    sock.sendall(b"T" + _LEN.pack(len(manifest_header)) + manifest_header + _LEN.pack(len(header)) + header
                 + payload[: STALL_AFTER_BYTES])
    return sock, payload[STALL_AFTER_BYTES:]


def _run_b(p0: Worker, d0: Worker, sent, at_b: m.Reserved) -> None:
    """Prefill b on p0 and hand its K/V to d0 over the workers' own sender and listener."""
    p0.handle(m.Prefill("b", PROMPT_B, PARAMS, 5, _plan(at_b, d0)))
    done = lambda: {(x.side, x.published) for w in ("p0", "d0") for x in sent[w]  # noqa: E731
                    if isinstance(x, m.TransferDone) and x.request_id == "b"} == {("source", True), ("destination", True)}
    _until(done, "b's transfer never published", pump=(p0, d0))


def _tokens(sent, wid: str, rid: str) -> list[int]:
    return [t for x in sent[wid] if isinstance(x, m.Tokens) for i in x.items if i.request_id == rid for t in i.token_ids]


def test_abort_under_an_open_landing_grant_frees_nothing_until_the_write_ends(workers):
    p0, d0, sent = workers
    at_a = _reserve(d0, sent, "a", PROMPT_A)
    assert at_a.ok and len(at_a.dest_blocks) == 4
    sock, rest = _stall_mid_payload(p0, d0, at_a)
    txn = d0.decode.endpoint.transfers[at_a.transfer_id]
    _until(lambda: txn.writers == 1, "the listener never granted the stalled chunk")

    d0.handle(m.Abort("a"))  # the client left: the router aborts at the decode worker
    assert txn.state is TxnState.ABORTED and txn.writers == 1
    assert "a" in d0.engine.imports, "blocks freed under an open landing grant"
    at_b = _reserve(d0, sent, "b", PROMPT_B)  # the next request, while a's late bytes may still land
    reused = set(at_b.dest_blocks) & set(at_a.dest_blocks) if at_b.ok else set()
    if at_b.ok:  # (only where a's blocks were handed out at once) b runs before a's bytes arrive
        _run_b(p0, d0, sent, at_b)
    sock.sendall(rest)  # the late bytes of a's chunk land
    sock.close()
    _until(lambda: txn.quiescent and "a" not in d0.engine.imports, "a's blocks never came back")
    if not at_b.ok:  # refused while a's blocks were held (no capacity); the router's retry gets them now
        assert at_b.reason == "no_kv_capacity"
        at_b = _reserve(d0, sent, "b", PROMPT_B)
        assert at_b.ok
        _run_b(p0, d0, sent, at_b)
    first = _tokens(sent, "p0", "b")
    d0.handle(m.StartDecode("b", first[0], 5))
    _until(lambda: any(i.finished for x in sent["d0"] if isinstance(x, m.Tokens) for i in x.items if i.request_id == "b"),
           "b never finished", pump=(p0, d0))

    ref = Engine(ENGINE).generate([list(PROMPT_B)], PARAMS)[0].output_ids
    assert first + _tokens(sent, "d0", "b") == list(ref)
    assert not reused, f"b was given blocks {sorted(reused)} while a's write into them was open"
    for w in (p0, d0):
        w.drain_events()
        w.engine.check_integrity()
        w.engine.assert_no_leaks()
    d0.decode.endpoint.assert_no_leaks()
    d0.decode.blocks.assert_no_leaks()


CHAIN = EngineConfig(model="tiny", dtype="float32", num_blocks=48, max_num_batched_tokens=64, num_threads=1)
CHAIN_PROMPT = tuple((i * 7919 + 13) % 250 + 3 for i in range(128))
SPLIT = 64  # the stage's prefix: 4 blocks, one chunk per layer


def test_an_admitted_chain_stage_aborted_under_a_write_keeps_its_blocks_until_the_write_ends():
    """A KV-Runahead stage is admitted once layer 0 of its prefix landed; the link then stalls in
    layer 1's payload and the stage is aborted: the engine keeps the stage's sequence (and its
    blocks) until the link is quiescent, then frees everything."""
    torch.set_num_threads(1)
    p0, p1 = (Worker(WorkerConfig(wid, "prefill", "tcp://127.0.0.1:9", engine=CHAIN)) for wid in ("p0", "p1"))
    sent: list = []
    p1.send = sent.append
    try:
        p1.handle(m.ReserveKv("r", "r/g1/ra1", 1, CHAIN_PROMPT, PARAMS, "p0", 1, chain_start=SPLIT))
        at = [x for x in sent if isinstance(x, m.Reserved)][-1]
        assert at.ok
        link = m.TransferPlan(at.transfer_id, 1, m.FIRST_ATTEMPT, "default", "p1", 1, at.reservation_id, at.dest_blocks,
                              at.num_visible_blocks, "tcp", p1.runahead.address)
        onward = m.TransferPlan("r/g1", 1, m.FIRST_ATTEMPT, "default", "d0", 1, "r/g1/res", tuple(range(8)), 0, "tcp",
                                ("127.0.0.1", 9))  # never reached: the stage never computes here
        p1.handle(m.Prefill("r", CHAIN_PROMPT, PARAMS, 5, onward, 0, m.ChainStage(1, 2, SPLIT, at.transfer_id)))
        manifest = p0.prefill.sender.manifest_for("r", CHAIN_PROMPT[:SPLIT], link, "default", "layerwise")
        layer0 = [c for c in manifest.chunks if c.layer == 0]
        layer1 = next(c for c in manifest.chunks if c.layer == 1)
        first = encode_frame(ManifestFrame(manifest))
        wire = b"T" + _LEN.pack(len(first)) + first
        for spec in layer0:  # zero K/V with its true checksum: layer 0 lands and the stage is admitted
            frame = encode_frame(ChunkFrame(at.transfer_id, manifest.fence, spec.chunk_id, 0, spec.nbytes,
                                            checksum_views([np.zeros(spec.nbytes, np.uint8)])))
            wire += _LEN.pack(len(frame)) + frame + bytes(spec.nbytes)
        stalled = encode_frame(ChunkFrame(at.transfer_id, manifest.fence, layer1.chunk_id, 1, layer1.nbytes, 0))
        sock = socket.create_connection(p1.runahead.address)
        sock.sendall(wire + _LEN.pack(len(stalled)) + stalled + bytes(STALL_AFTER_BYTES))
        txn = p1.runahead.endpoint.transfers[at.transfer_id]

        def admitted_and_writing() -> bool:
            p1.runahead.poll()
            return p1.runahead.links.get("r") is not None and p1.runahead.links["r"].admitted and txn.writers == 1
        _until(admitted_and_writing, "the stage was never admitted with layer 1 in flight")
        held = list(p1.engine.kv_blocks("r"))

        p1.handle(m.Abort("r"))
        assert txn.state is TxnState.ABORTED
        assert "r" in p1.engine.seqs and list(p1.engine.kv_blocks("r")) == held, "blocks freed under an open write"
        sock.sendall(bytes(layer1.nbytes - STALL_AFTER_BYTES))  # the late bytes land in the stage's own blocks
        sock.close()
        _until(lambda: (p1.runahead.poll(), not p1.runahead.draining)[1], "the stage never finished its abort")
        assert "r" not in p1.engine.seqs
        p1.engine.check_integrity()
        p1.engine.assert_no_leaks()
        p1.runahead.assert_no_leaks()
    finally:
        for w in (p0, p1):
            w.close()
