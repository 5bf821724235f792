"""Supervision of workers that hang or keep dying, and of requests that keep losing their worker,
driven through the served path: SIGSTOP and kill -9 on real worker processes under `cluster()`.

A stopped worker misses its heartbeats: it is retired, ended (SIGKILL after a grace) and started
again under its next epoch, while its requests finish elsewhere or end with an explicit error. A
worker killed `max_crashes` times within the window is FAILED (in /workers and the metrics), not
restarted forever. A request whose worker dies under it is moved at most `max_reroutes` times,
then ends with the explicit error `max_reroutes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from pdserve.api.backend import ErrorEvent, FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.supervisor import RestartPolicy
from tests.runtime.conftest import collect, config, prompt, wait_baseline
from tests.runtime.test_supervision import wait_epoch

FAST = RestartPolicy(first_delay_s=0.2, max_delay_s=1.0)


async def until(check, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def serves_then_settles(backend, seed: int) -> None:
    """One more request completes in full, then every pool is back at baseline with no router leak."""
    ids, event = await collect(backend, "after", prompt(24, seed), SamplingParams(max_tokens=8, ignore_eos=True))
    assert isinstance(event, FinishEvent) and len(ids) == 8
    await wait_baseline(backend)
    backend.router.assert_no_leaks()


def test_a_stopped_decode_worker_is_retired_killed_and_replaced_while_its_requests_finish(caplog):
    params = SamplingParams(max_tokens=300, ignore_eos=True)  # ~7 s of decode on 2 cores: in flight when the worker stops

    async def main():
        cfg = config(num_decode=2, restart=FAST, heartbeat_timeout_s=2.0)
        async with cluster(cfg) as (backend, launcher):
            tasks = [asyncio.create_task(collect(backend, f"r{i}", prompt(24, i), params)) for i in range(4)]
            await until(lambda: all(backend.live.get(f"r{i}") and backend.live[f"r{i}"].output_ids for i in range(4)),
                        what="every request streaming")
            victim = backend.live["r0"].decode_id
            pid = launcher.pid(victim)
            os.kill(pid, signal.SIGSTOP)
            try:
                results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
                await wait_epoch(backend, victim, 2)
                await until(lambda: _gone(pid), 10, "the stopped process was ended")
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for ids, event in results:  # each finished in full or said why it did not
                assert (isinstance(event, FinishEvent) and len(ids) == 300) or isinstance(event, ErrorEvent), event
            assert sum(isinstance(e, FinishEvent) for _, e in results) >= 1
            assert launcher.pid(victim) != pid and launcher.num_restarts == 1
            assert "pdserve_hung_workers_total 1.0" in backend.metrics_text().decode()
            await serves_then_settles(backend, seed=9)
            # the log says why the worker was ended and that it is coming back
            said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{victim} (epoch 1)")]
            assert said[0] == (f"{victim} (epoch 1) sent no heartbeat for 2 s of the router's running time "
                               "(--heartbeat-timeout-s): retired as hung, ending its process"), said
            assert said[1].startswith(f"{victim} (epoch 1) killed by SIG") and "; restarting in " in said[1], said

    asyncio.run(main())


def test_a_crash_loop_ends_in_failed_instead_of_restarting_forever():
    policy = RestartPolicy(first_delay_s=0.1, max_delay_s=0.2, max_crashes=3, crash_window_s=300.0)

    async def main():
        async with cluster(config(num_decode=2, restart=policy)) as (backend, launcher):
            for epoch in (2, 3):
                launcher.kill("decode-1")
                await wait_epoch(backend, "decode-1", epoch)
            launcher.kill("decode-1")  # the third death within the window
            await until(lambda: any(w.id == "decode-1" and w.state == "failed" for w in backend.workers()), 30,
                        "decode-1 marked failed")
            await asyncio.sleep(1.0)  # well past the backoff: it stays down
            row = next(w for w in backend.workers() if w.id == "decode-1")
            assert (row.state, row.epoch, launcher.num_restarts) == ("failed", 3, 2)
            assert 'pdserve_workers_failed{worker="decode-1"} 1.0' in backend.metrics_text().decode()
            assert backend.healthy()  # decode-0 still serves
            await serves_then_settles(backend, seed=5)

    asyncio.run(main())


def test_a_request_whose_workers_keep_dying_ends_after_max_reroutes():
    """Each worker the request lands on is killed as soon as it streams the request's tokens
    (what a poison request does); with --max-reroutes 1 the second loss ends it with the
    explicit error, though a third decode worker could have taken it."""

    async def main():
        async with cluster(config(num_decode=3, max_reroutes=1)) as (backend, launcher):
            task = asyncio.create_task(collect(backend, "poison", prompt(24, 3),
                                               SamplingParams(max_tokens=3000, ignore_eos=True)))
            killed, streamed = [], 0
            for _ in range(2):
                def streams_on_a_new_worker() -> bool:
                    live = backend.live.get("poison")
                    return live is not None and live.decode_id not in killed and len(live.output_ids) > streamed + 1

                await until(streams_on_a_new_worker, 60, "streaming on a new worker")
                live = backend.live["poison"]
                killed.append(live.decode_id)
                streamed = len(live.output_ids)
                launcher.kill(killed[-1])
                await until(lambda: killed[-1] not in backend.registered, 10, "the kill seen")
            ids, event = await asyncio.wait_for(task, timeout=60)
            assert isinstance(event, ErrorEvent) and event.code == "max_reroutes", event
            assert "max-reroutes 1" in event.message and len(ids) < 3000
            assert "pdserve_reroute_limit_total 1.0" in backend.metrics_text().decode()
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


def test_a_restarted_worker_that_hangs_before_it_registers_is_ended_and_started_again():
    """A restart that never registers (stopped, or stuck loading) sends no heartbeat, so the
    heartbeat watchdog never sees it: past the policy's registration timeout it is ended like a
    hung worker and started again under its next epoch."""
    policy = RestartPolicy(first_delay_s=0.2, max_delay_s=1.0, register_timeout_s=15.0)

    async def main():
        async with cluster(config(num_decode=2, restart=policy)) as (backend, launcher):
            first = launcher.pid("decode-1")
            launcher.kill("decode-1")
            await until(lambda: launcher.pid("decode-1") != first, 30, "decode-1 started again")
            stuck = launcher.pid("decode-1")
            os.kill(stuck, signal.SIGSTOP)  # hangs while it loads: it never registers
            try:
                await until(lambda: _gone(stuck), 60, "the restart that never registered was ended")
                await until(lambda: any(w.id == "decode-1" and w.state == "live" and w.epoch >= 3 and w.load
                                        for w in backend.workers()), 60, "decode-1 replaced again")
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stuck, signal.SIGKILL)
            assert "decode-1" not in launcher.failed()
            await serves_then_settles(backend, seed=4)

    asyncio.run(main())


def test_a_lost_worker_leaves_no_load_gauges_behind():
    """Per-worker load gauges describe live incarnations only: once a worker dies (here FAILED
    at once, so never registered again) /metrics must not keep showing its last batch and the
    blocks its requests held."""
    policy = RestartPolicy(max_crashes=1)

    async def main():
        async with cluster(config(num_decode=2, restart=policy)) as (backend, launcher):
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            tasks = [asyncio.create_task(collect(backend, f"r{i}", prompt(24, i), params)) for i in range(4)]
            await until(lambda: (load := backend.loads.get("decode-1")) is not None and load.active_decode > 0, 60,
                        "decode-1 reports a decode batch")
            launcher.kill("decode-1")
            await until(lambda: "decode-1" in launcher.failed() and "decode-1" not in backend.registered, 30,
                        "decode-1 failed")
            await until(lambda: 'pdserve_workers_failed{worker="decode-1"} 1.0' in backend.metrics_text().decode(), 10)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            text = backend.metrics_text().decode()
            stale = [line for line in text.splitlines() if 'worker="decode-1"' in line
                     and not line.startswith(("#", "pdserve_workers_failed"))]
            assert stale == [], stale
            assert 'pdserve_free_blocks{worker="decode-0"}' in text  # the live one still reports
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())
