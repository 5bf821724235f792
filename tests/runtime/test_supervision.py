"""Supervision: a worker killed with kill -9 starts again under a new epoch and takes traffic."""

from __future__ import annotations

import asyncio
import time

from pdserve.api.backend import ErrorEvent, FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.supervisor import RestartPolicy
from tests.runtime.conftest import collect, config, prompt, wait_baseline

FAST = RestartPolicy(first_delay_s=0.2, max_delay_s=1.0)


async def wait_epoch(backend, worker_id: str, epoch: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(w.id == worker_id and w.epoch == epoch and w.state == "live" and w.load for w in backend.workers()):
        assert time.monotonic() < deadline, [(w.id, w.epoch) for w in backend.workers()]
        await asyncio.sleep(0.1)


def test_killed_workers_come_back_under_new_epochs_and_serve():
    """Three kills on 1P1D (decode, prefill, decode again): each time the worker is replaced
    under the next epoch and the cluster serves a request end to end."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main():
        async with cluster(config(restart=FAST)) as (backend, launcher):
            for n, victim in enumerate(["decode-0", "prefill-0", "decode-0"]):
                launcher.kill(victim)
                await wait_epoch(backend, victim, 3 if n == 2 else 2)
                ids, event = await collect(backend, f"after-{n}", prompt(24, n), params)
                assert isinstance(event, FinishEvent) and len(ids) == 6
            assert launcher.num_restarts == 3
            assert sorted((w.id, w.epoch) for w in backend.workers()) == [("decode-0", 3), ("prefill-0", 2)]
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


def test_no_restart_leaves_the_dead_worker_out():
    async def main():
        async with cluster(config(restart=RestartPolicy(enabled=False), num_decode=2)) as (backend, launcher):
            launcher.kill("decode-1")
            deadline = time.monotonic() + 60
            while any(w.id == "decode-1" for w in backend.workers()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # well past the first backoff: nothing came back
            assert launcher.num_restarts == 0 and all(w.id != "decode-1" for w in backend.workers())

    asyncio.run(main())


def test_an_n_request_whose_decode_worker_dies_mid_output_ends_as_the_server_s_fault():
    """kill -9 the decode worker while an n = 2 request streams, with a second decode worker
    alive to recompute on: the choices cannot resume there (the engine resumes one sequence's
    output), so the request ends with the worker's loss (`worker_lost`, a 503), not the engine's
    refusal read as the client's 400; the other decode worker then serves an n = 2 request whole,
    and nothing leaks."""
    params = SamplingParams(max_tokens=400, ignore_eos=True, n=2)

    async def main():
        async with cluster(config(num_decode=2)) as (backend, launcher):
            running = asyncio.create_task(collect(backend, "n2", prompt(24, 7), params))
            deadline = time.monotonic() + 60
            while not ((live := backend.live.get("n2")) and len(live.output_ids) >= 4):
                assert time.monotonic() < deadline and not running.done()
                await asyncio.sleep(0.01)
            victim = live.decode_id
            launcher.kill(victim)
            tokens, event = await asyncio.wait_for(running, 120)
            assert isinstance(event, ErrorEvent) and event.code == "worker_lost", event
            assert 0 < len(tokens) < 2 * 400
            ids, done = await collect(backend, "after", prompt(24, 8), SamplingParams(max_tokens=6, ignore_eos=True, n=2))
            assert isinstance(done, FinishEvent) and len(ids) == 12
            assert all(w.id != victim for w in backend.workers())
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


def test_an_n_request_does_not_wait_for_a_restart_it_could_not_resume_on():
    """The same with the only decode worker killed and restarts on: the request ends `worker_lost`
    at once rather than waiting for the new worker (where it could only be refused) or ending as
    `kv_not_visible`."""
    params = SamplingParams(max_tokens=400, ignore_eos=True, n=2)

    async def main():
        async with cluster(config(restart=FAST)) as (backend, launcher):
            running = asyncio.create_task(collect(backend, "n2", prompt(24, 9), params))
            deadline = time.monotonic() + 60
            while not ((live := backend.live.get("n2")) and len(live.output_ids) >= 4):
                assert time.monotonic() < deadline and not running.done()
                await asyncio.sleep(0.01)
            launcher.kill(live.decode_id)
            _, event = await asyncio.wait_for(running, 120)
            assert isinstance(event, ErrorEvent) and event.code == "worker_lost", event
            await wait_epoch(backend, "decode-0", 2)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())
