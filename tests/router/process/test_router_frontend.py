"""The router process's backend (router/process/frontend.py) driven with typed worker messages, no worker
processes: a worker lost while a request is still in admission.

A request is in admission from its route until a worker owns it (the decode reservation is
answered and Prefill is sent). If a worker on that route dies meanwhile, the admission must route
it again over the live workers at once: recovering it as a recompute as well would run it twice,
and the admission would wait out the reservation timeout for an answer that never comes (then
try again, every answer dropped, until a 503). Every scenario ends with the router's hold ledger
empty. No wall clock: the event loop is stepped until the next message is sent.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.sequence import SamplingParams
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.contract import FinishEvent, GenerationRequest, TokenEvent
from pdserve.router.process.frontend import ClusterBackend
from pdserve.router.router import Router
from pdserve.workers import messages as m
from tests.router.router_fixtures import ABI, MODEL

PROMPT = tuple(range(3, 23))  # 20 tokens
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


class Harness:
    """A backend whose sends are recorded and whose dead workers the test names."""

    def __init__(self, prefill: list[str], decode: list[str]):
        router = Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="jsq"))
        self.dead: list[str] = []
        self.backend = ClusterBackend(router, "test", None, 4096, "tcp://127.0.0.1:*", is_dead=self._take_dead)
        self.sent: list[tuple[str, object]] = []
        self.backend._send = self._record  # the test double for the zmq socket
        self.epochs: dict[str, int] = {}
        for wid, role in [(w, "prefill") for w in prefill] + [(w, "decode") for w in decode]:
            self.join(wid, role)

    async def _record(self, worker_id: str, msg) -> bool:
        self.sent.append((worker_id, msg))
        return worker_id not in self.dead

    def _take_dead(self) -> list[str]:
        gone, self.dead = self.dead, []
        return gone

    def join(self, worker_id: str, role: str) -> None:
        self.epochs[worker_id] = 1
        self.backend._on_register(m.Register(worker_id, 1, "h0", role, 0, 1000, 16, MODEL, ABI, 64, 4096,
                                             handoff_address=("127.0.0.1", 1)))
        self.report(worker_id, applied=0)

    def report(self, worker_id: str, applied: int) -> None:
        load = m.Load(0, 0, 0, 1000, 0, applied, 1000)
        self.backend.report_load(m.Heartbeat(worker_id, self.epochs[worker_id], load))

    async def deliver(self, msg) -> None:
        await self.backend._on_message(msg)

    async def kill(self, worker_id: str) -> None:
        self.dead.append(worker_id)
        await self.backend.reap_lost_workers()

    async def next_sent(self, kind: type, steps: int = 500) -> tuple[str, object]:
        """Step the event loop until a message of `kind` is sent (and take it), or fail."""
        for _ in range(steps):
            for i, (wid, msg) in enumerate(self.sent):
                if isinstance(msg, kind):
                    del self.sent[: i + 1]
                    return wid, msg
            await asyncio.sleep(0)
        raise AssertionError(f"no {kind.__name__} sent; sent: {self.sent}")

    def sent_kinds(self) -> list[str]:
        return [type(msg).__name__ for _, msg in self.sent]

    async def serve(self, prefill_id: str, decode_id: str, reserve: m.ReserveKv, prefill: m.Prefill) -> None:
        """What a healthy P/D pair answers after Prefill: first token, publication, the rest, finish."""
        rid = prefill.request_id
        first = m.TokenItem(rid, (7,), "", False, None, len(PROMPT), 0, prefilled=True)
        await self.deliver(m.Tokens(prefill_id, 1, (first,)))
        wid, start = await self.next_sent(m.StartDecode)
        assert wid == decode_id and start.request_id == rid
        await self.deliver(m.TransferDone(decode_id, 1, rid, reserve.transfer_id, reserve.generation, "destination", True))
        rest = m.TokenItem(rid, (8, 9, 10, 11), "", True, "length", len(PROMPT), 0)
        await self.deliver(m.Tokens(decode_id, 1, (rest,)))


async def collect(backend: ClusterBackend, rid: str) -> tuple[list[int], object]:
    tokens: list[int] = []
    async for event in backend.submit(GenerationRequest(rid, PROMPT, PARAMS)):
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        else:
            return tokens, event
    return tokens, None


async def finish(h: Harness, task: asyncio.Task) -> None:
    ids, event = await task
    assert isinstance(event, FinishEvent) and ids == [7, 8, 9, 10, 11]
    assert not h.backend.live
    h.backend.router.assert_no_leaks()


def test_decode_lost_before_answering_the_reservation_reroutes_at_once():
    """1P2D: the decode worker holding a request's unanswered reservation dies. The admission
    routes the request to the survivor straight away (no recompute, no reservation timeout),
    and the request completes through the normal disaggregated path."""

    async def main():
        h = Harness(["p0"], ["d0", "d1"])
        task = asyncio.create_task(collect(h.backend, "r"))
        victim, first = await h.next_sent(m.ReserveKv)
        survivor = "d1" if victim == "d0" else "d0"
        await h.kill(victim)
        wid, reserve = await h.next_sent(m.ReserveKv)
        assert wid == survivor and reserve.request_id == "r" and reserve.transfer_id != first.transfer_id
        assert "Generate" not in h.sent_kinds()  # the admission re-routed it: no recompute beside it
        await h.deliver(m.Reserved(survivor, 1, "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        wid, prefill = await h.next_sent(m.Prefill)
        assert wid == "p0" and prefill.plan.dest_worker == survivor
        await h.serve("p0", survivor, reserve, prefill)
        await finish(h, task)

    asyncio.run(main())


def test_prefill_lost_after_the_reservation_was_granted_returns_it_and_reroutes():
    """2P1D: the decode worker granted the reservation, then the chosen prefill worker died before
    the admission resumed. The decode worker is told to return the blocks, and the request is
    routed again to the surviving prefill worker."""

    async def main():
        h = Harness(["p0", "p1"], ["d0"])
        task = asyncio.create_task(collect(h.backend, "r"))
        _, first = await h.next_sent(m.ReserveKv)
        victim = h.backend.live["r"].prefill_id
        survivor = "p1" if victim == "p0" else "p0"
        await h.deliver(m.Reserved("d0", 1, "r", first.transfer_id, True, None, (0, 1), 0, "res"))
        await h.kill(victim)  # before the admission coroutine ran again
        wid, abort = await h.next_sent(m.Abort)
        assert wid == "d0" and abort.request_id == "r"
        wid, reserve = await h.next_sent(m.ReserveKv)
        assert wid == "d0" and reserve.source_worker == survivor
        await h.deliver(m.Reserved("d0", 1, "r", reserve.transfer_id, True, None, (2, 3), 0, "res2"))
        wid, prefill = await h.next_sent(m.Prefill)
        assert wid == survivor and "Generate" not in h.sent_kinds()
        await h.serve(survivor, "d0", reserve, prefill)
        await finish(h, task)

    asyncio.run(main())


@pytest.mark.parametrize("victim_role", ["decode", "prefill"])
def test_owned_request_still_recovers_when_its_worker_dies(victim_role):
    """Once a worker owns the request (Prefill sent), losing a worker of its route takes the
    recompute fallback on a live decode worker, and its holds are still released exactly once."""

    async def main():
        h = Harness(["p0", "p1"], ["d0", "d1"])
        task = asyncio.create_task(collect(h.backend, "r"))
        decode_id, reserve = await h.next_sent(m.ReserveKv)
        await h.deliver(m.Reserved(decode_id, 1, "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        prefill_id, _ = await h.next_sent(m.Prefill)
        victim = decode_id if victim_role == "decode" else prefill_id
        await h.kill(victim)
        target, generate = await h.next_sent(m.Generate)
        assert target in {"d0", "d1"} - {victim} and generate.request_id != "r"  # a fresh engine id
        done = m.TokenItem(generate.request_id, (7, 8, 9, 10, 11), "", True, "length", len(PROMPT), 0)
        await h.deliver(m.Tokens(target, 1, (done,)))
        await finish(h, task)

    asyncio.run(main())


def test_a_restarted_worker_is_waited_for_until_its_first_load_report_not_only_its_registration():
    """1P1D, restarts on: the prefill worker dies and its restart registers. Until its first load
    report it is not routable (registry: REGISTERED, not LIVE), so it is still away: a request in
    that window waits in admission and is routed once the report comes. Before, registration alone
    ended the wait, and such a request answered 503 `no_route` (helper-40: 3 to 7 requests per kill
    of prefill-0 on a served 1P1D cluster)."""

    async def main():
        h = Harness(["p0"], ["d0"])
        h.backend.restarts = True
        await h.kill("p0")
        h.epochs["p0"] = 2
        h.backend._on_register(m.Register("p0", 2, "h0", "prefill", 0, 1000, 16, MODEL, ABI, 64, 4096,
                                          handoff_address=("127.0.0.1", 1)))
        task = asyncio.create_task(collect(h.backend, "r"))
        for _ in range(50):  # admission polls: give it time to have answered, were it to answer
            await asyncio.sleep(0.01)
        assert not task.done(), task.result()
        h.report("p0", applied=0)
        wid, reserve = await sent_within(h, m.ReserveKv, 30.0)  # the admission's next poll (ADMISSION_POLL_S)
        assert wid == "d0"
        await h.deliver(m.Reserved("d0", 1, "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        wid, prefill = await h.next_sent(m.Prefill)
        assert wid == "p0"
        first = m.TokenItem("r", (7,), "", False, None, len(PROMPT), 0, prefilled=True)
        await h.deliver(m.Tokens("p0", 2, (first,)))  # the restarted incarnation's epoch
        await h.next_sent(m.StartDecode)
        await h.deliver(m.TransferDone("d0", 1, "r", reserve.transfer_id, reserve.generation, "destination", True))
        await h.deliver(m.Tokens("d0", 1, (m.TokenItem("r", (8, 9, 10, 11), "", True, "length", len(PROMPT), 0),)))
        await finish(h, task)

    asyncio.run(main())


async def sent_within(h: Harness, kind: type, timeout_s: float) -> tuple[str, object]:
    """`Harness.next_sent` for a message sent after a timed poll: waits on the clock, not on steps."""
    for _ in range(int(timeout_s / 0.01)):
        if any(isinstance(msg, kind) for _, msg in h.sent):
            return await h.next_sent(kind)
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {kind.__name__} sent within {timeout_s} s; sent: {h.sent}")
