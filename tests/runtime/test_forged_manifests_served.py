"""A peer that names a real transfer in a forged first manifest, against served clusters (issue 35).

A listener admits a link only for a transfer that is reserved, unfinished and carried by no other
link (workers/handoff_io.py `_claim`). The forger here is this test on a raw socket; it knows the
transfer ids because they are built from ids the router gives out (`<request id>/g<generation>`,
`<request id>/fetch<n>`):
  * a forged manifest naming a fetch that already landed, sent to the fetching worker's fetch
    listener: closed unanswered. Before, the finished transfer's tombstone admitted it and the
    listener reported the transfer's end a second time, and the worker, inserting the already
    retired fetch into its prefix cache again, died of the KeyError;
  * a forged manifest naming the transfer a real link is carrying, sent to the decode worker's
    handoff listener: closed unanswered, and the transfer goes on. Before, the forger was
    admitted beside the real link and its capability's refusal aborted the real transfer.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import pytest

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.frames import ManifestFrame, encode_frame
from pdserve.handoff.trace import TraceSink
from pdserve.handoff.transports.channels import _LEN
from pdserve.workers import messages as m
from pdserve.workers.handoff_io import HandoffSender
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline
from tests.runtime.served_http import open_stream, served_app
from tests.runtime.test_handoff_faults_served import _failures, _hold_prefill, _stall_mid_payload, _until
from tests.runtime.test_kv_index_runtime import until

HISTORY = prompt(96, 11)  # six full blocks
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
PARAMS8 = SamplingParams(max_tokens=8, ignore_eos=True)  # a request whose source a test holds


@pytest.fixture(scope="module")
def reference():
    return Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))


def _forged_manifest(reference: Engine, transfer_id: str) -> bytes:
    """A well-formed first frame naming `transfer_id`, with a capability nobody signed."""
    sender = HandoffSender("prefill-0", 1, reference.pool, reference.identity, TraceSink(), on_done=None)
    plan = m.TransferPlan(transfer_id, 1, m.FIRST_ATTEMPT, "default", "decode-0", 1, "res", (0,), 0, "tcp",
                          ("127.0.0.1", 1))
    manifest = sender.manifest_for("forged", prompt(16, 1), plan, "default", "serialized")
    body = encode_frame(ManifestFrame(manifest, b"\x00" * 64))
    return b"T" + _LEN.pack(len(body)) + body


def _answer_to(address, first: bytes, timeout_s: float = 10.0) -> bytes | None:
    """What the listener sends back before it closes the connection (None: still open after
    `timeout_s`)."""
    sock = socket.create_connection(tuple(address), timeout=timeout_s)
    try:
        sock.sendall(first)
        got = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return got
            if not data:
                return got
            got += data
    except socket.timeout:
        return None
    finally:
        sock.close()


def test_a_forged_manifest_for_a_landed_fetch_is_closed_and_the_worker_serves_on(reference):
    async def main():
        cfg = config(mode="colocated", replicas=2, policy="round_robin")  # turn 2 fetches turn 1's history
        async with cluster(cfg) as (backend, launcher):
            first, event = await collect(backend, "t1", HISTORY, PARAMS)
            assert isinstance(event, FinishEvent)
            await until(lambda: all(backend.router.kv_holders(k) for k in backend._block_hashes(HISTORY)))
            turn2 = HISTORY + tuple(first) + prompt(20, 12)
            second, event = await collect(backend, "t2", turn2, PARAMS)
            assert isinstance(event, FinishEvent)
            await wait_baseline(backend)
            line = next(line for line in backend.trace.recent if line["request_id"] == "t2")
            assert line["fetch"] == "fetch"  # t2's history came over a fetch link "t2/fetch1"
            before = {w.id: (w.pid, w.epoch) for w in backend.workers()}
            forged = _forged_manifest(reference, "t2/fetch1")
            for reg in list(backend.registered.values()):
                answer = await asyncio.to_thread(_answer_to, reg.fetch_address, forged)
                assert answer == b"", f"{reg.worker_id}'s fetch listener answered a forged manifest: {answer!r}"
            again, event = await collect(backend, "t3", turn2, PARAMS)
            assert isinstance(event, FinishEvent) and again == second
            assert {w.id: (w.pid, w.epoch) for w in backend.workers()} == before, "a worker died or restarted"
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


@pytest.fixture(scope="module")
def served():
    from tests.runtime.shared_cluster import SharedCluster
    cluster_ = SharedCluster(config(engine=EngineConfig(model="tiny", num_blocks=5), transport="tcp"))
    yield cluster_
    cluster_.close()


def test_a_forged_manifest_for_a_transfer_in_flight_is_closed_and_the_transfer_goes_on(served, reference, monkeypatch):
    async def main(backend, _launcher):
        async with served_app(backend) as port:
            held, _ = _hold_prefill(monkeypatch, backend)
            client = await open_stream(port, prompt(64, 11), SamplingParams(max_tokens=8, ignore_eos=True))
            worker_id, prefill = await asyncio.wait_for(held, 30)
            failures = _failures(backend)
            # the real link: the router's signed plan, its manifest and the first bytes of a chunk
            sock, _rest = await asyncio.to_thread(_stall_mid_payload, backend, reference, worker_id, prefill)
            try:
                await asyncio.sleep(0.5)  # the listener admitted the real link
                forged = _forged_manifest(reference, prefill.plan.transfer_id)
                answer = await asyncio.to_thread(_answer_to, prefill.plan.dest_address, forged)
                await asyncio.sleep(0.5)
                failed = _failures(backend) - failures
            finally:
                client.close()  # the test's own source never finishes: end the request
                sock.close()
            assert answer == b"", f"the listener answered a second link for a transfer in flight: {answer!r}"
            assert failed == 0, "the forged link ended the real transfer"
            assert await _until(lambda: prefill.request_id not in backend.live, 30.0)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))


@dataclass(frozen=True)
class HeldSourceRun:
    """What `run_with_a_held_source` saw: the forger's own result, whether the request finished
    with the engine's tokens, its trace line and the transfer failures counted meanwhile."""
    forged: object
    finished: bool
    tokens_ok: bool
    line: dict
    failures: float


async def run_with_a_held_source(backend, monkeypatch, reference, rid: str, ids: tuple[int, ...], forger) -> HeldSourceRun:
    """Serve request `rid` (8 greedy tokens of `ids`) while the router's Prefill to its prefill
    worker is held, so only this test knows the transfer id: `forger(prefill, start_source,
    request)` acts as a peer that races the real source, and calls `start_source()` to let the
    real Prefill go (`request` is the request's task, to wait on while it goes on forging)."""
    original = backend._send
    held, _ = _hold_prefill(monkeypatch, backend)
    request = asyncio.create_task(collect(backend, rid, ids, PARAMS8))
    worker_id, prefill = await asyncio.wait_for(held, 30)
    failures = _failures(backend)
    forged = await forger(prefill, lambda: original(worker_id, prefill), request)
    tokens, event = await asyncio.wait_for(request, 60)
    line = next(line for line in backend.trace.recent if line["request_id"] == rid)
    want = list(reference.generate([list(ids)], PARAMS8)[0].output_ids)
    return HeldSourceRun(forged, isinstance(event, FinishEvent), tokens == want, line, _failures(backend) - failures)


def test_a_forged_manifest_before_the_real_source_is_refused_and_the_transfer_still_publishes(served, reference,
                                                                                             monkeypatch):
    """An unauthenticated peer (its capability is not the router's) that names a reserved transfer
    before the real source connects is answered with its refusal and closed; the transaction is
    left as it was, so the real source's link is admitted afterwards and the request is handed off
    with no failure and no recompute. Before, the forger took the transfer's one link and its
    refused capability aborted the transfer: the request was recomputed on the decode worker."""
    async def forge_three_times(prefill, start_source, _request):
        forged = _forged_manifest(reference, prefill.plan.transfer_id)
        answers = [await asyncio.to_thread(_answer_to, prefill.plan.dest_address, forged) for _ in range(3)]
        await start_source()  # the real source starts only now
        return answers

    async def main(backend, _launcher):
        run = await run_with_a_held_source(backend, monkeypatch, reference, "early", prompt(64, 13), forge_three_times)
        assert run.failures == 0, "a forged manifest ended the real transfer"
        assert run.finished and run.tokens_ok
        assert all(answer for answer in run.forged), "a forger was closed without its refusal"
        assert run.line["kv_bytes"] > 0 and "kv_failure" not in run.line  # handed off, the transfer never failed
        assert run.line["reroutes"] == run.line["retries"] == 0 and run.line["decode_start"] in ("wait", "enqueue")
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))
