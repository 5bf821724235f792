"""attack2 probes: forged first manifests racing the real source (served cluster, tcp)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from pdserve.api.backend import FinishEvent
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import collect, prompt, wait_baseline
from tests.runtime.test_forged_manifests_served import _answer_to, _forged_manifest, reference, served  # noqa: F401
from tests.runtime.test_handoff_faults_served import _failures, _hold_prefill


def _flood(address, frame: bytes, stop: threading.Event, hold: bool, socks: list, counts: dict):
    while not stop.is_set():
        try:
            sock = socket.create_connection(tuple(address), timeout=5)
            sock.sendall(frame)
            data = sock.recv(65536)
            counts["answered" if data else "closed"] = counts.get("answered" if data else "closed", 0) + 1
            if hold:
                socks.append(sock)  # never hang up: the listener waits PEER_CLOSE_WAIT_S on a slot
            else:
                sock.close()
        except OSError:
            counts["err"] = counts.get("err", 0) + 1


def _race(served, reference, monkeypatch, hold: bool, threads: int):
    out, rid = {}, f"raced-{hold}"

    async def main(backend, _launcher):
        original = backend._send
        held, _ = _hold_prefill(monkeypatch, backend)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        ids = prompt(64, 17)
        request = asyncio.create_task(collect(backend, rid, ids, params))
        worker_id, prefill = await asyncio.wait_for(held, 30)
        failures = _failures(backend)
        frame = _forged_manifest(reference, prefill.plan.transfer_id)
        stop, socks, counts = threading.Event(), [], {}
        flood = [threading.Thread(target=_flood, args=(prefill.plan.dest_address, frame, stop, hold, socks, counts))
                 for _ in range(threads)]
        [t.start() for t in flood]
        await asyncio.sleep(0.5)
        await original(worker_id, prefill)  # the real source, while the forgers go on
        try:
            tokens, event = await asyncio.wait_for(request, 60)
        finally:
            stop.set()
            await asyncio.to_thread(lambda: [t.join() for t in flood])
            for s in socks:
                s.close()
        line = next(line for line in backend.trace.recent if line["request_id"] == rid)
        out.update(failures=_failures(backend) - failures, counts=counts, line=line,
                   tokens_ok=tokens == list(reference.generate([list(ids)], params)[0].output_ids),
                   finished=isinstance(event, FinishEvent))
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))
    print(out)
    return out


def test_a_tight_loop_of_forgers_racing_the_real_source(served, reference, monkeypatch):
    out = _race(served, reference, monkeypatch, hold=False, threads=8)
    assert out["finished"] and out["tokens_ok"]
    assert out["failures"] == 0 and "kv_failure" not in out["line"], out


def test_forgers_that_never_hang_up_racing_the_real_source(served, reference, monkeypatch):
    out = _race(served, reference, monkeypatch, hold=True, threads=8)
    assert out["finished"] and out["tokens_ok"]
    assert out["failures"] == 0 and "kv_failure" not in out["line"], out


def _revoked_looking_manifest(reference, transfer_id: str) -> bytes:
    """A first manifest whose capability is signed by nobody's key but claims an older key epoch
    (0): its claims are read before the signature is checked, so a bad signature reads as revoked."""
    import msgspec

    from pdserve.handoff.capability import Claims, new_nonce, new_signing_key, sign
    from pdserve.handoff.frames import ManifestFrame, encode_frame
    from pdserve.handoff.trace import TraceSink
    from pdserve.handoff.transports.channels import _LEN
    from pdserve.workers import messages as m
    from pdserve.workers.handoff_io import HandoffSender

    sender = HandoffSender("prefill-0", 1, reference.pool, reference.identity, TraceSink(), on_done=None)
    plan = m.TransferPlan(transfer_id, 1, m.FIRST_ATTEMPT, "default", "decode-0", 1, "res", (0,), 0, "tcp",
                          ("127.0.0.1", 1))
    manifest = sender.manifest_for("forged", prompt(16, 1), plan, "default", "serialized")
    claims = Claims(0, "default", "prefill-0", 1, "decode-0", 1, transfer_id, 1, "x", "push", (0,), 1,
                    time.time() + 60, new_nonce())
    body = encode_frame(ManifestFrame(manifest, sign(new_signing_key(), claims)))
    return b"T" + _LEN.pack(len(body)) + body


def test_a_forger_claiming_an_older_key_epoch_is_turned_away_too(served, reference, monkeypatch):
    """Before: the forged signature with key epoch 0 was denied as capability_revoked, which is not
    one of the turned-away reasons, so the forger's refusal aborted the real transfer."""
    async def main(backend, _launcher):
        original = backend._send
        held, _ = _hold_prefill(monkeypatch, backend)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        ids = prompt(64, 19)
        request = asyncio.create_task(collect(backend, "epoch0", ids, params))
        worker_id, prefill = await asyncio.wait_for(held, 30)
        failures = _failures(backend)
        answer = await asyncio.to_thread(_answer_to, prefill.plan.dest_address,
                                         _revoked_looking_manifest(reference, prefill.plan.transfer_id))
        await original(worker_id, prefill)
        tokens, event = await asyncio.wait_for(request, 60)
        line = next(line for line in backend.trace.recent if line["request_id"] == "epoch0")
        assert answer, "the forger got no refusal"
        assert _failures(backend) - failures == 0 and "kv_failure" not in line, line
        assert isinstance(event, FinishEvent) and tokens == list(reference.generate([list(ids)], params)[0].output_ids)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))
