"""Hostile and failing handoff peers against a served 1P1D cluster over TCP (issue 35).

The peer is this test, on a real socket into the served decode worker's handoff listener:
  * a 6-byte message claiming a 256 MiB frame header: the connection is closed before the worker
    allocates it (the bound follows from the K/V ABI and the pool: handoff/limits.py), and the
    listener goes on serving real handoffs;
  * as many slow-loris peers as the listener has connection slots, each trickling a header it
    claimed: every one is closed within the first frame's deadline (one I/O timeout), so the
    slots come back and a real handoff that waited in the accept queue behind them completes;
  * the prefill side of a request that stops in the middle of a chunk's payload (the router's
    Prefill is held back from the real prefill worker and its signed plan used here: what a
    SIGSTOP mid-payload looks like on the wire), then the client closes its HTTP connection and a
    new request arrives that needs the same blocks, and the late bytes land. The new request's
    tokens equal one engine's: the aborted request's blocks came back only after its write ended.
Every scenario ends at baseline with the router's leak check. The pool is tight on purpose (five
blocks per worker): the aborted request's blocks are the only ones the next request can get.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from pdserve.api.backend import FinishEvent, GenerationRequest, TokenEvent
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.frames import ChunkFrame, ManifestFrame, encode_frame
from pdserve.handoff.trace import TraceSink
from pdserve.handoff.transports.channels import _LEN
from pdserve.handoff.transports.server import MAX_CONNECTIONS
from pdserve.workers import messages as m
from pdserve.workers.handoff_io import HandoffSender
from tests.helpers.sockets import closed_by_peer
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline
from tests.runtime.served_http import open_stream, served_app
from tests.runtime.shared_cluster import SharedCluster

TIGHT = EngineConfig(model="tiny", num_blocks=5)
CLAIMED_HEADER_BYTES = 256 << 20
STALL_AFTER_BYTES = 16  # the source stops 16 bytes into chunk 0: every later byte of it lands late


@pytest.fixture(scope="module")
def served():
    cluster = SharedCluster(config(engine=TIGHT, transport="tcp"))
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def reference():
    return Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib << 10


def test_an_oversized_frame_header_closes_the_link_unallocated_and_the_listener_serves_on(served, reference):
    async def main(backend, launcher):
        dest = backend.registered["decode-0"]
        pid = launcher.pid("decode-0")
        before = _rss_bytes(pid)
        hostile = socket.create_connection(tuple(dest.handoff_address))
        hostile.sendall(b"T" + struct.pack("<I", CLAIMED_HEADER_BYTES) + b"\x00")  # 6 bytes claiming 256 MiB
        t0 = time.monotonic()
        closed = await asyncio.to_thread(closed_by_peer, hostile, 10.0)
        closed_s, grown = time.monotonic() - t0, _rss_bytes(pid) - before
        hostile.close()
        assert closed, "the listener kept a connection that declared a 256 MiB header"
        assert grown < 32 << 20, f"the worker grew by {grown >> 20} MiB for a 6-byte message"
        assert closed_s < 5.0
        for i, n in enumerate((20, 47)):  # real handoffs over the same listener afterwards
            p, s = prompt(n, i), SamplingParams(max_tokens=6, ignore_eos=True)
            ids, event = await collect(backend, f"after-{i}", p, s)
            assert isinstance(event, FinishEvent) and ids == list(reference.generate([list(p)], s)[0].output_ids)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))


def _trickle_until_closed(socks: list[socket.socket], every_s: float, within_s: float) -> int:
    """Send each open socket one byte every `every_s` until the peer closed all (or `within_s`
    passed); returns how many were still open."""
    open_socks, deadline = list(socks), time.monotonic() + within_s
    while open_socks and time.monotonic() < deadline:
        for sock in list(open_socks):
            try:
                sock.send(b"\x00")
            except OSError:  # reset or broken pipe: the listener closed it
                open_socks.remove(sock)
        time.sleep(every_s)
    return len(open_socks)


def test_slow_loris_peers_on_every_slot_are_cut_and_a_real_handoff_gets_through(served, reference):
    async def main(backend, _launcher):
        address = tuple(backend.registered["decode-0"].handoff_address)
        peers = [socket.create_connection(address) for _ in range(MAX_CONNECTIONS)]
        for peer in peers:
            peer.sendall(b"T" + struct.pack("<I", 4096))  # a header it never finishes
        trickler = asyncio.create_task(asyncio.to_thread(_trickle_until_closed, peers, 0.5, 25.0))
        p, s = prompt(40, 5), SamplingParams(max_tokens=6, ignore_eos=True)
        ids, event = await collect(backend, "behind-the-loris", p, s)  # its link waits for a slot
        still_open = await trickler
        for peer in peers:
            peer.close()
        assert still_open == 0, f"{still_open} of {MAX_CONNECTIONS} trickling peers kept their slot for 25 s"
        assert isinstance(event, FinishEvent) and ids == list(reference.generate([list(p)], s)[0].output_ids)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))


def _failures(backend) -> float:
    return sum(sample.value for metric in backend.metrics.kv_transfer_failures.collect()
               for sample in metric.samples if sample.name.endswith("_total"))


def test_a_flood_of_idle_connections_neither_fills_the_listener_nor_fails_a_real_handoff(served, reference):
    """More silent peers than the listener's slots and its accept queue together (64 + 128): they
    only evict one another, so a real transfer is admitted as it arrives instead of waiting out
    one I/O timeout per 64 of them (and failing: its own reads time out meanwhile)."""
    async def main(backend, _launcher):
        address = tuple(backend.registered["decode-0"].handoff_address)
        failures, moved = _failures(backend), backend.metrics.kv_transfer_bytes._value.get()
        idle = [socket.create_connection(address, timeout=10) for _ in range(MAX_CONNECTIONS + 128 + 64)]
        try:
            for i, n in enumerate((40, 23)):
                p, s = prompt(n, 30 + i), SamplingParams(max_tokens=6, ignore_eos=True)
                ids, event = await collect(backend, f"beside-the-flood-{i}", p, s)
                assert isinstance(event, FinishEvent) and ids == list(reference.generate([list(p)], s)[0].output_ids)
                assert _failures(backend) == failures, "a real handoff failed behind idle connections"
                assert backend.metrics.kv_transfer_bytes._value.get() > moved  # it was handed off, not recomputed
                moved = backend.metrics.kv_transfer_bytes._value.get()
        finally:
            for peer in idle:
                peer.close()
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))


def _hold_prefill(monkeypatch, backend) -> tuple[asyncio.Future, set[str]]:
    """Test wrapper: the router's first Prefill never reaches the prefill worker; the future gets
    it (with its signed transfer plan) so this test can act as that worker's sender. The set
    collects the request ids of every Prefill sent (a Prefill follows a granted reservation)."""
    held, send, prefills = asyncio.get_running_loop().create_future(), backend._send, set()

    async def send_but_hold(worker_id: str, msg) -> bool:
        if isinstance(msg, m.Prefill):
            prefills.add(msg.request_id)
            if not held.done():
                held.set_result((worker_id, msg))
                return True
        return await send(worker_id, msg)
    monkeypatch.setattr(backend, "_send", send_but_hold)
    return held, prefills


async def _until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _stall_mid_payload(backend, reference, worker_id: str, msg: m.Prefill) -> tuple[socket.socket, bytes]:
    """Open the held request's link as its prefill worker would, send the manifest (with the
    router's capability) and the first bytes of chunk 0's payload; returns the socket and the rest."""
    src = backend.registered[worker_id]
    sender = HandoffSender(worker_id, src.epoch, reference.pool, reference.identity, TraceSink(), on_done=None)
    plan = msg.plan
    manifest = sender.manifest_for(msg.request_id, msg.prompt_ids, plan, plan.tenant, "serialized")
    spec = manifest.chunks[0]
    first = encode_frame(ManifestFrame(manifest, plan.capability))
    header = encode_frame(ChunkFrame(plan.transfer_id, manifest.fence, spec.chunk_id, spec.layer, spec.nbytes, 0))
    payload = bytes([0x5A]) * spec.nbytes  # K/V nobody computed: no request may ever read it
    sock = socket.create_connection(tuple(plan.dest_address))
    sock.sendall(b"T" + _LEN.pack(len(first)) + first + _LEN.pack(len(header)) + header + payload[: STALL_AFTER_BYTES])
    return sock, payload[STALL_AFTER_BYTES:]


async def _consume(stream, tokens: list[int], started: asyncio.Event):
    """Read `stream` to its terminal event, collecting tokens; `started` is set at the first."""
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
            started.set()
        else:
            return event
    return None


def test_disconnect_mid_payload_then_a_request_on_the_same_blocks_decodes_exactly(served, reference, monkeypatch):
    async def main(backend, _launcher):
        async with served_app(backend) as port:
            held, prefills = _hold_prefill(monkeypatch, backend)
            client = await open_stream(port, prompt(64, 11), SamplingParams(max_tokens=8, ignore_eos=True))  # 4 blocks + 1 growth
            worker_id, prefill = await asyncio.wait_for(held, 30)
            sock, rest = await asyncio.to_thread(_stall_mid_payload, backend, reference, worker_id, prefill)
            await asyncio.sleep(0.5)  # the listener admits the link and grants the chunk's landing
            client.close()  # the client hangs up: the server aborts a at the decode worker
            assert await _until(lambda: prefill.request_id not in backend.live, 30.0)
            await b_then_c(backend, reference, prefills, sock, rest)

    served.run(main(served.backend, served.launcher))


async def b_then_c(backend, reference, prefills: set[str], sock: socket.socket, rest: bytes) -> None:
    # b (3 prompt blocks + 2 of growth) fits only in a's blocks: it gets a reservation (and its
    # Prefill is sent) only where they came back at the abort; there b runs to its end first
    b = GenerationRequest("b", prompt(47, 12), SamplingParams(max_tokens=24, ignore_eos=True))
    tokens_b, started = [], asyncio.Event()
    consumer = asyncio.create_task(_consume(backend.submit(b), tokens_b, started))
    if await _until(lambda: "b" in prefills, 3.0):
        await asyncio.wait_for(asyncio.shield(consumer), 120)
    sock.sendall(rest)  # a's late bytes land
    sock.close()
    assert isinstance(await asyncio.wait_for(consumer, 120), FinishEvent)
    await asyncio.sleep(0.5)  # the listener is done with a's link
    # c repeats b's prompt: the decode worker's prefix cache serves its leading blocks
    ids_c, event_c = await collect(backend, "c", b.prompt_ids, b.params)
    assert isinstance(event_c, FinishEvent)
    want = list(reference.generate([list(b.prompt_ids)], b.params)[0].output_ids)
    assert tokens_b == want and ids_c == want
    await wait_baseline(backend)
    backend.router.assert_no_leaks()

