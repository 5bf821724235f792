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

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.frames import ChunkFrame, ManifestFrame, encode_frame
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
