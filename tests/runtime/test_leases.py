"""K/V leases in the running cluster: renewed while the router lives, reclaimed once it stops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from pdserve.api.backend import FinishEvent, GenerationRequest
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import collect, config, prompt, wait_baseline


async def _until(predicate, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def _load(backend, worker_id: str) -> dict:
    return next(w.load for w in backend.workers() if w.id == worker_id)


def test_a_stalled_prefill_longer_than_the_lease_keeps_its_reservation():
    """The prefill worker is frozen for 2.5 leases; the router keeps renewing (every 0.67 s),
    nothing expires, and the request completes."""
    async def main():
        async with cluster(config(lease_s=2.0)) as (backend, launcher):
            os.kill(launcher.pid("prefill-0"), signal.SIGSTOP)
            task = asyncio.create_task(collect(backend, "slow", prompt(64, 1), SamplingParams(max_tokens=8, ignore_eos=True)))
            await asyncio.sleep(5.0)
            os.kill(launcher.pid("prefill-0"), signal.SIGCONT)
            ids, event = await asyncio.wait_for(task, 120)
            assert isinstance(event, FinishEvent) and len(ids) == 8
            await wait_baseline(backend)
            assert _load(backend, "prefill-0")["leases_expired"] == 0 and _load(backend, "decode-0")["leases_expired"] == 0

    asyncio.run(main())


def _free(backend, worker_id: str) -> bool:
    load = _load(backend, worker_id)
    return load["free_blocks"] == load["num_blocks"] and load["reserved_blocks"] == 0


async def _abandon(backend, stream, pending) -> None:
    """The client leaves (what the HTTP layer does on a disconnect); everything returns."""
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await pending
    await stream.aclose()
    await wait_baseline(backend)


def _orphan(monkeypatch, backend, launcher, seed: int):
    """Test wrapper: the router stops renewing leases (as one that died would); the prefill
    worker is frozen and one request submitted. Returns (stream, its pending first event)."""
    async def none():
        return None
    monkeypatch.setattr(backend, "renew_leases", none)
    os.kill(launcher.pid("prefill-0"), signal.SIGSTOP)
    stream = backend.submit(GenerationRequest("orphan", prompt(64, seed), SamplingParams(max_tokens=8, ignore_eos=True)))
    return stream, asyncio.create_task(anext(stream))


def test_unrenewed_decode_reservation_is_reclaimed(monkeypatch):
    """No renewals and a frozen prefill worker: the decode worker reclaims the reservation after
    one lease, though the router still holds the request."""
    async def main():
        async with cluster(config(lease_s=1.0)) as (backend, launcher):
            stream, pending = _orphan(monkeypatch, backend, launcher, 2)
            await _until(lambda: _load(backend, "decode-0")["leases_expired"] == 1, what="decode never reclaimed")
            assert _free(backend, "decode-0") and "orphan" in backend.live
            os.kill(launcher.pid("prefill-0"), signal.SIGCONT)
            await _until(lambda: _free(backend, "prefill-0"), what="prefill kept blocks")
            await _abandon(backend, stream, pending)

    asyncio.run(main())


def test_unrenewed_prefill_pin_is_reclaimed_while_its_transfer_stalls(monkeypatch):
    """No renewals; the decode worker freezes after reserving, so the prefill's transfer (a pull
    link: the decode worker copies out of the prefill's pool) stalls: the prefill worker reclaims
    its request after one lease (the transfer is cancelled first), but its source copy stays
    pinned while the frozen reader may still copy from it (no timer releases it); once the decode
    worker runs again it hangs up and both pools are free."""
    async def main():
        async with cluster(config(lease_s=1.0)) as (backend, launcher):
            stream, pending = _orphan(monkeypatch, backend, launcher, 3)
            await _until(lambda: _load(backend, "decode-0")["reserved_blocks"] > 0, what="decode never reserved")
            os.kill(launcher.pid("decode-0"), signal.SIGSTOP)
            os.kill(launcher.pid("prefill-0"), signal.SIGCONT)
            await _until(lambda: _load(backend, "prefill-0")["leases_expired"] == 1, what="prefill never reclaimed")
            await asyncio.sleep(3.0)  # past the 2 s after which the source copy used to be released anyway
            assert not _free(backend, "prefill-0"), "source blocks released while their pull reader may copy them"
            os.kill(launcher.pid("decode-0"), signal.SIGCONT)
            await _until(lambda: _free(backend, "prefill-0"), what="prefill kept blocks after the reader hung up")
            await _until(lambda: _free(backend, "decode-0"), what="decode kept its reservation")
            await _abandon(backend, stream, pending)

    asyncio.run(main())
