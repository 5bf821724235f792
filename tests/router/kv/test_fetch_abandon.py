"""FetchRunner with its sends recorded (no workers): a fetch waited on by two requests goes on when
one of them is cancelled, and is abandoned (FetchAbort to the destination and the holder, result
"abandoned") when the last one is. The served trigger: tests/runtime/test_fetch_disconnect_served.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from pdserve.router.kv.fetch_plan import FETCH, FetchTerms
from pdserve.router.kv.fetch_runner import FetchRunner
from pdserve.workers import messages as m
from pdserve.workers.prefix_fetch.fetch_control import FETCH_SUFFIX

TERMS = FetchTerms(FETCH, "holder", 0, 2, 2 << 16, 0.001, 0.1)
KEYS = (11, 12)


class _Backend:
    def __init__(self):
        self.metrics = SimpleNamespace(registry=CollectorRegistry())
        self.registered = {w: SimpleNamespace(epoch=1) for w in ("dest", "holder")}
        self._block_size = 16
        self.sent: list[tuple[str, object]] = []

    async def _send(self, worker_id: str, msg) -> bool:
        self.sent.append((worker_id, msg))
        return True


class _Live:
    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self.req = SimpleNamespace(prompt_ids=tuple(range(40)), tenant="default")
        self.trace: dict = {}

    def note(self, **fields) -> None:
        self.trace.update(fields)


def _aborted(backend: _Backend) -> set[str]:
    return {wid.removesuffix(FETCH_SUFFIX) for wid, msg in backend.sent if isinstance(msg, m.FetchAbort)}


def _abandoned(runner: FetchRunner) -> float:
    return runner.fetches.labels("abandoned")._value.get()


def test_one_waiter_cancelled_leaves_the_fetch_to_the_other_the_last_abandons_it():
    async def main():
        backend = _Backend()
        runner = FetchRunner(backend)
        owner, joined = _Live("r1"), _Live("r2")
        first = asyncio.create_task(runner._own(owner, "dest", KEYS, TERMS, 0))
        await asyncio.sleep(0.05)  # reserve and pin sent; nobody answers
        running = runner._inflight[("dest", KEYS[-1])]
        second = asyncio.create_task(runner._await_landed(joined, running))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.sleep(0.1)
        assert not _aborted(backend) and runner.pending and not running.landed.done()  # r2 still waits on it
        second.cancel()
        await asyncio.sleep(0.1)
        assert _aborted(backend) == {"dest", "holder"}
        assert not runner.pending and not runner._inflight and running.landed.result() == 0
        assert _abandoned(runner) == 1 and joined.trace["fetch_failure"] == "abandoned"

    asyncio.run(main())



def test_a_fetch_whose_only_waiter_leaves_at_once_tells_every_side_it_reached_and_frees_its_keys():
    """The request is cancelled in the loop turn after it created the fetch: whatever the fetch had
    sent by then, each side it reached gets a FetchAbort, and its blocks are no longer in flight
    (a later request owns a fresh fetch instead of joining a dead one)."""
    async def main():
        backend = _Backend()
        runner = FetchRunner(backend)
        first = asyncio.create_task(runner._own(_Live("r1"), "dest", KEYS, TERMS, 0))
        await asyncio.sleep(0)  # _own ran up to its wait: the fetch's task exists
        running = runner._inflight[("dest", KEYS[-1])]
        first.cancel()
        await asyncio.sleep(0.05)
        assert running.task.cancelled() and running.landed.result() == 0
        reached = {wid.removesuffix(FETCH_SUFFIX) for wid, msg in backend.sent if not isinstance(msg, m.FetchAbort)}
        assert reached <= _aborted(backend) and not runner.pending and not runner._inflight
        assert _abandoned(runner) == 1
        later = asyncio.create_task(runner._own(_Live("r2"), "dest", KEYS, TERMS, 0))
        await asyncio.sleep(0.05)
        assert runner._inflight[("dest", KEYS[-1])] is not running  # its own fetch, not the dead one
        later.cancel()
        await asyncio.sleep(0.05)

    asyncio.run(main())
