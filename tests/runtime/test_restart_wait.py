"""A request whose only decode worker dies under it waits for the worker's restart instead of
failing (router/process/recovery.py, RESTART_WAIT), on a served 1P1D cluster with real kill -9:
it finishes on the new incarnation with one engine's tokens. A worker that is not coming back
(FAILED by the crash-loop limit) ends the wait at once with the explicit error."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pdserve.api.backend import ErrorEvent, FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.supervisor import RestartPolicy
from tests.runtime.conftest import TINY, WORKER_THREADS, collect, config, prompt, wait_baseline
from tests.runtime.test_supervision import wait_epoch

PARAMS = SamplingParams(max_tokens=300, ignore_eos=True)
# the second death within the window is the last: decode-0 is FAILED, not restarted
POLICY = RestartPolicy(first_delay_s=0.2, max_delay_s=1.0, max_crashes=2, crash_window_s=600.0)


async def until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def fallbacks(backend) -> dict[str, float]:
    text = backend.metrics_text().decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("pdserve_fallback_total{")}


async def kill_while_streaming(backend, launcher, rid: str, ids) -> tuple[list[int], object]:
    task = asyncio.create_task(collect(backend, rid, ids, PARAMS))
    await until(lambda: (live := backend.live.get(rid)) is not None and len(live.output_ids) > 20, 120,
                f"{rid} streaming from decode-0")
    launcher.kill("decode-0")
    return await asyncio.wait_for(task, 120)


def test_a_request_waits_for_its_only_decode_worker_to_restart_and_one_that_is_not_coming_back_ends_it(caplog):
    reference = Engine(replace(TINY, num_threads=WORKER_THREADS))
    ids_1, ids_2 = prompt(24, 1), prompt(24, 2)

    async def main():
        # admission's wait (the bound of the restart wait too) far past the test's: a wait that
        # missed the FAILED worker would outlast it
        async with cluster(config(restart=POLICY, admission_wait_s=600.0)) as (backend, launcher):
            tokens, event = await kill_while_streaming(backend, launcher, "r1", ids_1)
            assert isinstance(event, FinishEvent), event
            assert tokens == list(reference.generate([list(ids_1)], PARAMS)[0].output_ids)
            assert fallbacks(backend).get("restart_wait") == 1.0 and fallbacks(backend).get("recompute") == 1.0
            await wait_epoch(backend, "decode-0", 2)
            tokens, event = await kill_while_streaming(backend, launcher, "r2", ids_2)  # its second death
            assert isinstance(event, ErrorEvent) and event.code == "kv_not_visible", event
            assert "decode-0" in launcher.failed() and len(tokens) < PARAMS.max_tokens
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
        # the operator's log says how each death happened and what the supervisor does about it
        deaths = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode-0 (epoch")]
        assert deaths[0].startswith("decode-0 (epoch 1) killed by SIGKILL; restarting in "), deaths
        assert deaths[1] == ("decode-0 (epoch 2) killed by SIGKILL; FAILED: 2 deaths within 600 s (--max-crashes 2); "
                             "not started again"), deaths

    asyncio.run(main())
