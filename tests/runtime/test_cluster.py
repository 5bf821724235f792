"""The disaggregated runtime end to end with real worker processes (tiny model)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from dataclasses import replace

import pytest

from pdserve.api.backend import ErrorEvent, FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import TINY, WORKER_THREADS, collect, config, prompt, wait_baseline
from tests.runtime.shared_cluster import SharedCluster


@pytest.fixture(scope="module")
def reference_engine():
    return Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))


@pytest.fixture(scope="module")
def default_1p1d():
    """`config()` (1P1D, transport auto) served once for the tests below that leave it at baseline."""
    served = SharedCluster(config())
    yield served
    served.close()


def serve(request, cfg, body) -> None:
    """Run `body(backend, launcher)` on a cluster of `cfg`: the module's shared 1P1D one when `cfg`
    is the default deployment, else a cluster of its own."""
    if cfg == config():
        served = request.getfixturevalue("default_1p1d")
        served.run(body(served.backend, served.launcher))
        return

    async def main():
        async with cluster(cfg) as (backend, launcher):
            await body(backend, launcher)

    asyncio.run(main())


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_1p1d_tokens_equal_engine_and_pools_return_to_baseline(request, reference_engine, transport):
    async def main(backend, _):
        cases = [(prompt(n, i), SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, seed=7 + i))
                 for i, (n, t) in enumerate([(20, 0.0), (300, 0.0), (33, 0.9), (520, 0.7)])]
        results = await asyncio.gather(*(collect(backend, f"r{i}", p, s) for i, (p, s) in enumerate(cases)))
        for (ids, event), (p, s) in zip(results, cases):
            assert isinstance(event, FinishEvent) and event.finish_reason == "length"
            assert ids == list(reference_engine.generate([list(p)], s)[0].output_ids)
        views = await wait_baseline(backend)
        assert {w.role for w in views} == {"prefill", "decode"}
        backend.router.assert_no_leaks()
        text = backend.metrics_text().decode()
        assert "pdserve_kv_transfer_bytes_total" in text and 'result="routed"' in text

    serve(request, config(transport=transport), main)


def test_small_prefill_chunks_stream_progressively_and_stay_exact():
    """With 64-token prefill chunks a 300-token prompt's K/V stream chunk by chunk while later
    chunks compute (the producer gate's watermarks); tokens equal a local engine's."""
    chunked = replace(TINY, max_num_batched_tokens=64)
    reference = Engine(replace(chunked, kv_cache_bytes=0, num_blocks=128, num_threads=WORKER_THREADS))

    async def main():
        async with cluster(config(engine=chunked, transport="auto", layerwise_threshold_tokens=64)) as (backend, _):
            cases = [(prompt(n, 40 + i), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=i))
                     for i, n in enumerate((300, 129, 64))]
            results = await asyncio.gather(*(collect(backend, f"s{i}", p, s) for i, (p, s) in enumerate(cases)))
            for (ids, event), (p, s) in zip(results, cases):
                assert isinstance(event, FinishEvent)
                assert ids == list(reference.generate([list(p)], s)[0].output_ids)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 2)])
def test_xpyd_serves_100_concurrent_requests(request, shape):
    async def main(backend, _):
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        results = await asyncio.gather(*(collect(backend, f"c{i}", prompt(8 + i % 40, i), params) for i in range(100)))
        assert all(isinstance(e, FinishEvent) and len(ids) == 6 for ids, e in results)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    serve(request, config(num_prefill=shape[0], num_decode=shape[1]), main)


def test_colocated_mode_serves_and_matches_engine(reference_engine):
    async def main():
        async with cluster(config(mode="colocated", replicas=2)) as (backend, _):
            p, s = prompt(50, 1), SamplingParams(max_tokens=10, ignore_eos=True)
            ids, event = await collect(backend, "co", p, s)
            assert isinstance(event, FinishEvent) and ids == list(reference_engine.generate([list(p)], s)[0].output_ids)
            await wait_baseline(backend)

    asyncio.run(main())


@pytest.mark.parametrize("victim_role, stalled", [("decode", False), ("prefill", False), ("decode", True)],
                         ids=["decode", "prefill", "decode-stalled"])
def test_kill_9_worker_mid_stream_every_request_ends(victim_role, stalled):
    """kill -9 one worker while streams are in flight: each request completes (rerouted or
    recomputed) or ends with an explicit error, none hangs, new requests are served, and the
    router's hold ledger ends empty. Where the kill lands in a request's life depends on the
    machine's speed; `stalled` freezes the victim (SIGSTOP) before the streams start, so the kill
    always finds decode reservations it never answered (a slow worker's state at the kill)."""
    shape = (1, 2) if victim_role == "decode" else (2, 1)

    async def main():
        async with cluster(config(num_prefill=shape[0], num_decode=shape[1])) as (backend, launcher):
            if stalled:
                os.kill(launcher.pid(f"{victim_role}-0"), signal.SIGSTOP)
            params = SamplingParams(max_tokens=60, ignore_eos=True)
            tasks = [asyncio.create_task(collect(backend, f"k{i}", prompt(30 + i, i), params)) for i in range(8)]
            await asyncio.sleep(1.5)
            launcher.kill(f"{victim_role}-0")
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            for ids, event in results:
                assert isinstance(event, (FinishEvent, ErrorEvent)), event
                if isinstance(event, FinishEvent):
                    assert len(ids) == 60
            ids, event = await collect(backend, "after", prompt(20, 99), SamplingParams(max_tokens=5, ignore_eos=True))
            assert isinstance(event, FinishEvent) and len(ids) == 5
            assert all(w.id != f"{victim_role}-0" for w in backend.workers())
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


def test_recompute_after_kill_gives_the_same_tokens(reference_engine):
    """A decode worker dies mid-stream; the request resumes elsewhere with the same seed."""
    async def main():
        async with cluster(config(num_prefill=1, num_decode=2)) as (backend, launcher):
            p, s = prompt(40, 5), SamplingParams(max_tokens=80, ignore_eos=True, temperature=0.8, seed=11)
            task = asyncio.create_task(collect(backend, "rec", p, s))
            while not backend.live.get("rec") or len(backend.live["rec"].output_ids) < 5:
                await asyncio.sleep(0.02)
            launcher.kill(backend.live["rec"].decode_id)
            ids, event = await asyncio.wait_for(task, timeout=300)
            assert isinstance(event, FinishEvent)
            assert ids == list(reference_engine.generate([list(p)], s)[0].output_ids)

    asyncio.run(main())


def test_disconnect_mid_stream_frees_blocks_on_both_workers(request):
    async def main(backend, _):
        from pdserve.api.backend import GenerationRequest

        stream = backend.submit(GenerationRequest("gone", prompt(100, 3), SamplingParams(max_tokens=400, ignore_eos=True)))
        seen = 0
        async for _event in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()  # what the HTTP layer does when the client leaves
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    serve(request, config(), main)


def test_finished_and_abandoned_transfers_leave_no_record_on_the_decode_worker(request, reference_engine):
    """A worker's handoff endpoint keeps a transfer's record only while something reads it: after
    24 handed-off requests and 6 client disconnects mid-stream the decode worker holds none (each
    record kept would be a few KB for the worker's life, and a forged manifest naming it was the
    way in to a finished transfer)."""
    async def main(backend, _):
        from pdserve.api.backend import GenerationRequest

        async def leave(rid: str) -> None:
            stream = backend.submit(GenerationRequest(rid, prompt(120, 50), SamplingParams(max_tokens=300, ignore_eos=True)))
            async for _event in stream:
                break  # the first token came: the transfer published, decode is running
            await stream.aclose()

        params = SamplingParams(max_tokens=4, ignore_eos=True)
        before = _transfers(backend)
        for wave in range(3):
            done = await asyncio.gather(*(collect(backend, f"k{wave}-{i}", prompt(30 + i, i), params) for i in range(8)),
                                        *(leave(f"gone{wave}-{i}") for i in range(2)))
            for i, (ids, event) in enumerate(done[:8]):
                assert isinstance(event, FinishEvent)
                assert ids == list(reference_engine.generate([list(prompt(30 + i, i))], params)[0].output_ids)
        views = await wait_baseline(backend)
        assert _transfers(backend) - before >= 24  # every finished request was handed off
        assert [w.load["handoff_records"] for w in views if w.role == "decode"] == [0]
        backend.router.assert_no_leaks()

    serve(request, config(), main)


def _transfers(backend) -> float:
    text = backend.metrics_text().decode()
    found = re.search(r"^pdserve_kv_transfer_attempts_total ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_invalid_requests_are_refused_before_routing(request):
    async def main(backend, _):
        from pdserve.engine.errors import InvalidRequest

        for ids, params in [((), SamplingParams()), ((1,) * 5000, SamplingParams()),
                            ((1, 2), SamplingParams(max_tokens=0)), ((1, 9999), SamplingParams())]:
            with pytest.raises(InvalidRequest):
                await collect(backend, "bad", ids, params)
        ids, event = await collect(backend, "good", prompt(10, 1), SamplingParams(max_tokens=3, ignore_eos=True))
        assert isinstance(event, FinishEvent)
        await wait_baseline(backend)

    serve(request, config(), main)


def test_a_request_no_decode_worker_could_ever_hold_is_an_early_400():
    """Not a 503 (clients retry those): even an idle cluster could never hold it (frontend_start.py)."""
    async def main():
        tight = EngineConfig(model="tiny", num_blocks=8)
        async with cluster(config(engine=tight)) as (backend, _):
            with pytest.raises(InvalidRequest, match="could never fit") as info:
                await collect(backend, "huge", prompt(200, 1), SamplingParams(max_tokens=1000, ignore_eos=True))
            assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())
