"""A peer that stops in the middle of a payload over TCP (what SIGSTOP of the other worker looks
like on the wire: the connection stays open and no byte moves), against real worker objects and
their own sender and listener threads. Each side ends the transfer with a report within the
lease (the socket timeout is a third of it: handoff/limits.py io_timeout_for_lease), and its blocks,
credits and sender slots come back without anyone's help.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.frames import ChunkFrame, ManifestFrame, encode_frame
from pdserve.handoff.states import TxnState
from pdserve.handoff.transports.channels import _LEN
from pdserve.workers import messages as m
from pdserve.workers.worker import Worker, WorkerConfig

LEASE_S = 3.0
ENGINE = EngineConfig(model="tiny", dtype="float32", num_blocks=160, max_num_batched_tokens=512, num_threads=1)
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _worker(wid: str, role: str) -> tuple[Worker, list]:
    torch.set_num_threads(1)
    # serialized transfers: all the K/V is ready when the link opens, so the stall comes at once
    worker = Worker(WorkerConfig(wid, role, "tcp://127.0.0.1:9", engine=ENGINE, lease_s=LEASE_S,
                                 layerwise_threshold_tokens=1 << 20))
    sent: list = []
    worker.send = sent.append
    return worker, sent


def _until(cond, what: str, timeout_s: float, worker: Worker | None = None) -> float:
    """Pump `worker` until `cond()`; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, what
        if worker is not None:
            worker.drain_events()
            if worker.engine.has_unfinished():
                worker.step()
        time.sleep(0.005)
    return time.monotonic() - t0


def _done(sent: list, side: str) -> list[m.TransferDone]:
    return [x for x in sent if isinstance(x, m.TransferDone) and x.side == side]


@pytest.fixture
def decode():
    d0, sent = _worker("d0", "decode")
    yield d0, sent
    d0.close()


@pytest.fixture
def prefill():
    p0, sent = _worker("p0", "prefill")
    yield p0, sent
    p0.close()


def test_a_source_that_stops_mid_payload_ends_the_destination_with_a_report_within_the_lease(decode, prefill):
    d0, sent = decode
    p0, _ = prefill  # only its manifest builder: the bytes come from this test's socket
    prompt = tuple(range(3, 67))
    d0.handle(m.ReserveKv("a", "a/g1", 1, prompt, PARAMS, "p0", 1))
    at = [x for x in sent if isinstance(x, m.Reserved)][-1]
    plan = m.TransferPlan(at.transfer_id, 1, m.FIRST_ATTEMPT, "default", "d0", 1, at.reservation_id, at.dest_blocks,
                          at.num_visible_blocks, "tcp", d0.decode.address)
    manifest = p0.prefill.sender.manifest_for("a", prompt, plan, "default", "serialized")
    spec = manifest.chunks[0]
    header, first = encode_frame(ChunkFrame(at.transfer_id, manifest.fence, spec.chunk_id, spec.layer, spec.nbytes, 0)), \
        encode_frame(ManifestFrame(manifest))
    source = socket.create_connection(d0.decode.address)
    source.sendall(b"T" + _LEN.pack(len(first)) + first + _LEN.pack(len(header)) + header + bytes(spec.nbytes // 2))
    txn = d0.decode.endpoint.transfers[at.transfer_id]
    _until(lambda: txn.writers == 1, "the chunk was never granted", 10.0)
    # the source stops here, half a payload in, its connection open
    took = _until(lambda: _done(sent, "destination"), "the destination never reported the stalled transfer",
                  LEASE_S, d0)
    report = _done(sent, "destination")[0]
    assert (report.request_id, report.published, report.reason) == ("a", False, "transport_failure")
    assert took < LEASE_S and txn.state is TxnState.ABORTED and txn.quiescent
    assert "a" not in d0.engine.imports and not d0.decode.holds("a")  # blocks back at once
    source.close()
    d0.handle(m.Abort("a"))  # the router's fallback also tells the decode worker: nothing left to do
    d0.engine.check_integrity()
    d0.engine.assert_no_leaks()
    d0.decode.endpoint.assert_no_leaks()
    d0.decode.blocks.assert_no_leaks()


def test_a_destination_that_stops_reading_mid_payload_ends_the_source_and_frees_its_slot(prefill):
    p0, sent = prefill
    sink = socket.socket()
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # a stopped reader fills quickly
    sink.bind(("127.0.0.1", 0))
    sink.listen(1)
    prompt = tuple((i * 31 + 7) % 250 + 3 for i in range(2000))  # ~16 MiB of K/V: more than both socket buffers
    blocks = tuple(range(125))
    plan = m.TransferPlan("a/g1", 1, m.FIRST_ATTEMPT, "default", "d0", 1, "a/g1/res", blocks, 0, "tcp",
                          sink.getsockname())
    p0.handle(m.Prefill("a", prompt, PARAMS, 5, plan))
    _until(lambda: "a" in p0.prefill.started, "the transfer never started", 60.0, p0)
    accepted, _ = sink.accept()  # and never read: the destination is stopped
    took = _until(lambda: _done(sent, "source"), "the source never reported the stalled transfer", LEASE_S + 60.0, p0)
    report = _done(sent, "source")[0]
    assert (report.request_id, report.published, report.reason) == ("a", False, "transport_failure")
    assert took < LEASE_S
    assert p0.prefill.sender.slots._value == 4  # every sender slot is back
    assert not p0.prefill.holds("a") and not p0.engine.prefilled  # the source copy was released
    accepted.close()
    sink.close()
    p0.handle(m.Abort("a"))
    p0.engine.check_integrity()
    p0.engine.assert_no_leaks()
