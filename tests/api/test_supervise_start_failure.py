"""A worker start that raises (the warm template died twice during it, workers/process/warm_start.py)
is a crash of that incarnation: the supervisor logs it, keeps supervising, starts the worker
again after the backoff, and marks it FAILED at the crash limit instead of retrying forever.
Before, the exception ended the supervisor's task silently and no worker was started again."""

from __future__ import annotations

import asyncio

from pdserve.api.server import ServeConfig
from pdserve.workers.process.launcher import Launcher
from pdserve.workers.process.supervisor import RestartPolicy


class _Impl:
    def __init__(self, failures: int):
        self.failures, self.starts = failures, []

    def restart(self, worker_id: str, epoch: int) -> None:
        self.starts.append((worker_id, epoch))
        if len(self.starts) <= self.failures:
            raise EOFError("unexpected EOF")  # what a template dying before its fork raises


def _supervised(failures: int, policy: RestartPolicy, done) -> Launcher:
    launcher = Launcher(ServeConfig(restart=policy))
    launcher.impl = _Impl(failures)
    launcher.schedule.on_started("decode-0", 1, launcher.clock())
    launcher.schedule.on_death("decode-0", launcher.clock())

    async def run():  # until `done` holds (60 s at most: no bound on the machine's speed), then a little longer
        task = asyncio.create_task(launcher.supervise(poll_s=0.01))
        for _ in range(6000):
            if done(launcher) or task.done():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # time for a start too many to show
        assert not task.done(), task  # still supervising
        task.cancel()

    asyncio.run(run())
    return launcher


def test_a_failed_start_is_retried_after_the_backoff():
    launcher = _supervised(2, RestartPolicy(first_delay_s=0.02, max_delay_s=0.05), lambda la: len(la.impl.starts) >= 3)
    assert launcher.impl.starts == [("decode-0", 2), ("decode-0", 3), ("decode-0", 4)]  # two failures, then started
    life = launcher.schedule.lives["decode-0"]
    assert life.epoch == 4 and life.due_s is None and not life.failed


def test_failed_starts_end_in_failed_at_the_crash_limit():
    launcher = _supervised(100, RestartPolicy(first_delay_s=0.02, max_delay_s=0.02, max_crashes=3),
                           lambda la: bool(la.schedule.failed()))
    assert len(launcher.impl.starts) == 2  # the death, then two failed starts: three crashes
    assert launcher.schedule.failed() == ["decode-0"]
