"""Forged first manifests racing the real source on a served cluster (tcp): forgers in a tight
loop, forgers that never hang up, and a forged signature that claims an older key epoch. Each is
turned away before its link may claim the transfer, so the real source's link is admitted and
the request is handed off with no transfer failure (handoff_io.py `_turned_away`)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from tests.runtime.conftest import prompt, wait_baseline
from tests.runtime.test_forged_manifests_served import (_answer_to, _forged_manifest, reference,  # noqa: F401
                                                         run_with_a_held_source, served)


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
    async def flood_around_the_source(prefill, start_source, request):
        frame = _forged_manifest(reference, prefill.plan.transfer_id)
        stop, socks, counts = threading.Event(), [], {}
        flood = [threading.Thread(target=_flood, args=(prefill.plan.dest_address, frame, stop, hold, socks, counts))
                 for _ in range(threads)]
        [t.start() for t in flood]
        await asyncio.sleep(0.5)
        await start_source()  # the real source, while the forgers go on
        try:
            await asyncio.wait_for(asyncio.shield(request), 60)
        finally:
            stop.set()
            await asyncio.to_thread(lambda: [t.join() for t in flood])
            for s in socks:
                s.close()
        return counts

    async def main(backend, _launcher):
        run = await run_with_a_held_source(backend, monkeypatch, reference, f"raced-{hold}", prompt(64, 17),
                                           flood_around_the_source)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        return run

    return served.run(main(served.backend, served.launcher))


def test_a_tight_loop_of_forgers_racing_the_real_source(served, reference, monkeypatch):
    run = _race(served, reference, monkeypatch, hold=False, threads=8)
    assert run.finished and run.tokens_ok
    assert run.failures == 0 and "kv_failure" not in run.line, run


def test_forgers_that_never_hang_up_racing_the_real_source(served, reference, monkeypatch):
    run = _race(served, reference, monkeypatch, hold=True, threads=8)
    assert run.finished and run.tokens_ok
    assert run.failures == 0 and "kv_failure" not in run.line, run


def _revoked_looking_manifest(reference, transfer_id: str) -> bytes:
    """A first manifest whose capability is signed by nobody's key but claims an older key epoch
    (0): its claims are read before the signature is checked, so a bad signature reads as revoked."""
    import msgspec

    from pdserve.handoff.trust.capability import Claims, new_nonce, new_signing_key, sign
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
    async def forge_once(prefill, start_source, _request):
        answer = await asyncio.to_thread(_answer_to, prefill.plan.dest_address,
                                         _revoked_looking_manifest(reference, prefill.plan.transfer_id))
        await start_source()
        return answer

    async def main(backend, _launcher):
        run = await run_with_a_held_source(backend, monkeypatch, reference, "epoch0", prompt(64, 19), forge_once)
        assert run.forged, "the forger got no refusal"
        assert run.failures == 0 and "kv_failure" not in run.line, run.line
        assert run.finished and run.tokens_ok
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))
