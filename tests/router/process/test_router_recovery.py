"""Every transfer failure reaches the router and takes the spec's decode-start chain
(router/process/recovery.py over router/process/fallback.py), driven with typed worker messages, no processes.

Faults are the messages a worker sends when they happen: the source could not open its link or
the destination refused it (TransferDone, side "source" or "destination", not published), a
transfer that stalls (no publication within the TTFT budget), a decode worker lost. Each ends
with both workers told to abort, the router's holds moved to the new route (released once,
taken again: the ledger is empty at the end), the outcome on the trace line and in the metric.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.kv.block_manager import prompt_block_hashes, root_hash
from pdserve.engine.kv.kv_events import BlockEvent, BlockEventKind, KvReport
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.contract import ErrorEvent, FinishEvent, Rejection
from pdserve.router.router import Router
from pdserve.workers import messages as m
from tests.router.router_fixtures import ABI, MODEL
from tests.router.process.test_router_frontend import PROMPT, Harness, collect


def harness(prefill, decode, ttft_slo_s: float = 30.0, prefix_identity: str = "") -> Harness:
    h = Harness.__new__(Harness)
    Harness.__init__(h, [], [])
    h.backend.router = Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="jsq", ttft_slo_s=ttft_slo_s))
    for wid, role in [(w, "prefill") for w in prefill] + [(w, "decode") for w in decode]:
        h.epochs[wid] = 1
        h.backend._on_register(m.Register(wid, 1, "h0", role, 0, 1000, 16, MODEL, ABI, 64, 4096,
                                          prefix_identity=prefix_identity, handoff_address=("127.0.0.1", 1)))
        h.report(wid, applied=0)
    return h


async def started(h: Harness, first_token: bool = True):
    """Submit "r", grant its reservation, and (optionally) deliver P's first token."""
    task = asyncio.create_task(collect(h.backend, "r"))
    decode_id, reserve = await h.next_sent(m.ReserveKv)
    await h.deliver(m.Reserved(decode_id, 1, "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
    prefill_id, _ = await h.next_sent(m.Prefill)
    if first_token:
        await h.deliver(m.Tokens(prefill_id, 1, (m.TokenItem("r", (7,), "", False, None, len(PROMPT), 0, prefilled=True),)))
    return task, prefill_id, decode_id, reserve


async def resumed(h: Harness, task, workers: set[str], resume: tuple[int, ...] = (7,)) -> tuple[str, m.Generate]:
    """The request resumed with Generate on one of `workers`, with a router hold there; finish it."""
    target, gen = await h.next_sent(m.Generate)
    assert target in workers and gen.resume_output_ids == resume and gen.grant_seq > 0
    assert h.backend.router.live_requests() == ("r",)  # the new route's hold, the old ones released
    rest = (7, 8, 9, 10, 11)[len(resume):]
    await h.deliver(m.Tokens(target, 1, (m.TokenItem(gen.request_id, rest, "", True, "length", len(PROMPT), 0),)))
    ids, event = await task
    assert isinstance(event, FinishEvent) and ids == [7, 8, 9, 10, 11]
    assert not h.backend.live
    h.backend.router.assert_no_leaks()
    return target, gen


def line(h: Harness) -> dict:
    return h.backend.trace.recent[-1]


def fallback_count(h: Harness, outcome: str) -> float:
    return h.backend.metrics.registry.get_sample_value("pdserve_fallback_total", {"outcome": outcome}) or 0.0


@pytest.mark.parametrize("side", ["source", "destination"])
def test_a_failed_link_after_the_first_token_aborts_both_sides_and_recomputes(side):
    """The source could not open its link (or the destination refused it): the router hears it
    from that side, tells both workers to abort and recomputes on a decode worker."""

    async def main():
        h = harness(["p0"], ["d0", "d1"])
        task, p, d, reserve = await started(h)
        await h.next_sent(m.StartDecode)
        worker = p if side == "source" else d
        await h.deliver(m.TransferDone(worker, 1, "r", reserve.transfer_id, reserve.generation, side, False,
                                       "transport_failure"))
        aborted = {wid for wid, msg in h.sent if isinstance(msg, m.Abort) and msg.request_id == "r"}
        assert aborted == {p, d}
        await resumed(h, task, {"d0", "d1"})
        assert (line(h)["fallback"], line(h)["decode_start"]) == ("recompute", "wait>recompute")
        assert line(h)["fallback_cause"] == f"transfer_failed:{side}:transport_failure"
        assert fallback_count(h, "recompute") == 1

    asyncio.run(main())


def test_a_source_failure_before_the_first_token_recomputes_when_it_arrives():
    async def main():
        h = harness(["p0"], ["d0"])
        task, p, d, reserve = await started(h, first_token=False)
        await h.deliver(m.TransferDone(p, 1, "r", reserve.transfer_id, reserve.generation, "source", False, "transport_failure"))
        assert "Generate" not in h.sent_kinds()
        await h.deliver(m.Tokens(p, 1, (m.TokenItem("r", (7,), "", False, None, len(PROMPT), 0, prefilled=True),)))
        assert "StartDecode" not in h.sent_kinds()  # the K/V will never be visible at D
        await resumed(h, task, {"d0"})
        assert line(h)["decode_start"] == "recompute" and line(h)["fallback_cause"] == "transfer_failed"

    asyncio.run(main())


def test_both_sides_reporting_one_failure_recover_once():
    async def main():
        h = harness(["p0"], ["d0"])
        task, p, d, reserve = await started(h)
        for wid, side in ((d, "destination"), (p, "source")):
            await h.deliver(m.TransferDone(wid, 1, "r", reserve.transfer_id, reserve.generation, side, False, "transport_failure"))
        await resumed(h, task, {"d0"})
        assert h.sent_kinds().count("Generate") == 0 and line(h)["retries"] == 1

    asyncio.run(main())


def test_a_lost_publish_ack_does_not_undo_a_published_kv():
    """The source gave up waiting for the publish ack after D had published: decode goes on."""

    async def main():
        h = harness(["p0"], ["d0"])
        task, p, d, reserve = await started(h)
        await h.deliver(m.TransferDone(d, 1, "r", reserve.transfer_id, reserve.generation, "destination", True))
        await h.deliver(m.TransferDone(p, 1, "r", reserve.transfer_id, reserve.generation, "source", False, "transport_failure"))
        await h.deliver(m.Tokens(d, 1, (m.TokenItem("r", (8, 9, 10, 11), "", True, "length", len(PROMPT), 0),)))
        ids, event = await task
        assert isinstance(event, FinishEvent) and "Generate" not in h.sent_kinds()
        assert "fallback" not in line(h) and line(h)["decode_start"] == "wait"
        h.backend.router.assert_no_leaks()

    asyncio.run(main())


def test_a_stalled_transfer_waits_out_the_ttft_budget_then_recomputes():
    async def main():
        h = harness(["p0"], ["d0"], ttft_slo_s=0.3)
        task, p, d, _ = await started(h)
        wid, _ = await h.next_sent(m.StartDecode)  # WAIT: D admits the K/V if it is published in time
        assert wid == d and "Generate" not in h.sent_kinds()
        await asyncio.sleep(0.35)  # the budget runs out, unpublished
        await resumed(h, task, {"d0"})
        assert line(h)["decode_start"] == "wait>recompute" and line(h)["fallback_cause"] == "wait_expired"
        assert fallback_count(h, "wait") == 0 and fallback_count(h, "recompute") == 1  # a first wait is the normal path

    asyncio.run(main())


def test_a_transfer_published_within_the_budget_is_waited_for():
    async def main():
        h = harness(["p0"], ["d0"], ttft_slo_s=0.3)
        task, p, d, reserve = await started(h)
        await h.deliver(m.TransferDone(d, 1, "r", reserve.transfer_id, reserve.generation, "destination", True))
        await asyncio.sleep(0.4)  # past the budget: the timer finds the K/V published and does nothing
        assert "Generate" not in h.sent_kinds()
        await h.deliver(m.Tokens(d, 1, (m.TokenItem("r", (8, 9, 10, 11), "", True, "length", len(PROMPT), 0),)))
        ids, event = await task
        assert isinstance(event, FinishEvent) and line(h)["decode_start"] == "wait"
        h.backend.router.assert_no_leaks()

    asyncio.run(main())


def test_reroute_to_the_decode_worker_whose_cache_sees_the_prompt():
    """d1's prefix cache holds every full prompt block: the K/V is visible there, so the chain
    reroutes to it instead of recomputing on the least loaded worker."""

    async def main():
        h = harness(["p0"], ["d0", "d1", "d2"], prefix_identity="model")
        hashes = prompt_block_hashes(root_hash("model"), PROMPT, 16)
        task, p, d, reserve = await started(h)
        holder = next(w for w in ("d0", "d1", "d2") if w != d)
        load = m.Load(0, 3, 3, 1000, 0, 0, 1000)  # busier than the third: only the cache draws it
        resync = KvReport(len(hashes), tuple(BlockEvent(BlockEventKind.STORED, x) for x in hashes), resync=True)
        h.backend.report_load(m.Heartbeat(holder, 1, load, resync))  # its whole prefix cache, as after a ResyncKv
        await asyncio.sleep(0)  # the K/V index applier's turn (router/kv/kv_inbox.py: events apply off the message path)
        await h.kill(d)
        target, _ = await resumed(h, task, {holder})
        assert line(h)["fallback"] == "reroute" and line(h)["fallback_cause"] == f"worker_lost:{d}"

    asyncio.run(main())


def test_no_live_decode_worker_fails_with_kv_not_visible():
    async def main():
        h = harness(["p0"], ["d0"])
        task, p, d, _ = await started(h)
        await h.kill(d)
        ids, event = await task
        assert isinstance(event, ErrorEvent) and event.code == "kv_not_visible" and ids == [7]
        assert ("p0", "Abort") in [(w, type(msg).__name__) for w, msg in h.sent]
        assert line(h)["fallback"] == "fail" and line(h)["error"] == "kv_not_visible"
        h.backend.router.assert_no_leaks()

    asyncio.run(main())


def rejoin(h: Harness, worker_id: str, role: str) -> None:
    """The supervisor started a dead worker again: it registers under its next epoch."""
    h.epochs[worker_id] += 1
    h.backend._on_register(m.Register(worker_id, h.epochs[worker_id], "h0", role, 0, 1000, 16, MODEL, ABI, 64, 4096,
                                      handoff_address=("127.0.0.1", 1)))
    h.report(worker_id, applied=0)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_request_waits_in_admission_while_the_only_worker_of_a_role_restarts(role):
    async def main():
        h = harness(["p0"], ["d0"])
        h.backend.restarts = True
        victim = "p0" if role == "prefill" else "d0"
        await h.kill(victim)
        task = asyncio.create_task(collect(h.backend, "r"))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not task.done() and "ReserveKv" not in h.sent_kinds()  # waiting, not a 503
        rejoin(h, victim, role)
        await asyncio.sleep(0.05)  # the admission's next poll
        _, reserve = await h.next_sent(m.ReserveKv)
        await h.deliver(m.Reserved("d0", h.epochs["d0"], "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        _, prefill = await h.next_sent(m.Prefill)
        first = m.TokenItem("r", (7,), "", False, None, len(PROMPT), 0, prefilled=True)
        await h.deliver(m.Tokens("p0", h.epochs["p0"], (first,)))
        await h.deliver(m.TransferDone("d0", h.epochs["d0"], "r", reserve.transfer_id, reserve.generation, "destination", True))
        await h.deliver(m.Tokens("d0", h.epochs["d0"], (m.TokenItem("r", (8, 9, 10, 11), "", True, "length", len(PROMPT), 0),)))
        ids, event = await task
        assert isinstance(event, FinishEvent) and ids == [7, 8, 9, 10, 11]
        h.backend.router.assert_no_leaks()

    asyncio.run(main())


def test_without_restarts_a_missing_role_is_rejected_at_once():
    async def main():
        h = harness(["p0"], ["d0"])
        await h.kill("p0")
        with pytest.raises(Rejection) as err:
            await collect(h.backend, "r")
        assert err.value.reason == "no_route"

    asyncio.run(main())


def test_a_request_queued_past_its_ttft_target_waits_for_its_landing_kv():
    """Admission held the request longer than the TTFT target (its only decode worker was being
    started again). Once routed, its prefill ran and its K/V is on the way: the decode-start wait
    is measured from the transfer's start, not from arrival, so the chain waits for the
    publication. Counted from arrival the budget was already spent, and with no room on d0 for a
    second hold the request failed `kv_not_visible` after its prefill work was done."""

    async def main():
        h = harness(["p0"], ["d0"], ttft_slo_s=0.3)
        h.backend.restarts = True
        await h.kill("d0")
        task = asyncio.create_task(collect(h.backend, "r"))
        await asyncio.sleep(0.4)  # queued in admission past the TTFT target
        assert not task.done() and "ReserveKv" not in h.sent_kinds()
        rejoin(h, "d0", "decode")
        full = m.Load(0, 0, 0, 2, 0, 0, 1000)  # room for this request's 2 blocks (20 + 5 tokens), no more
        h.backend.report_load(m.Heartbeat("d0", h.epochs["d0"], full))
        await asyncio.sleep(0.05)  # the admission's next poll
        _, reserve = await h.next_sent(m.ReserveKv)
        await h.deliver(m.Reserved("d0", h.epochs["d0"], "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        await h.next_sent(m.Prefill)
        first = m.TokenItem("r", (7,), "", False, None, len(PROMPT), 0, prefilled=True)
        await h.deliver(m.Tokens("p0", 1, (first,)))
        wid, _ = await h.next_sent(m.StartDecode)  # WAIT: the transfer has its whole budget ahead
        assert wid == "d0" and not task.done() and "Generate" not in h.sent_kinds()
        await h.deliver(m.TransferDone("d0", h.epochs["d0"], "r", reserve.transfer_id, reserve.generation, "destination", True))
        await h.deliver(m.Tokens("d0", h.epochs["d0"], (m.TokenItem("r", (8, 9, 10, 11), "", True, "length", len(PROMPT), 0),)))
        ids, event = await task
        assert isinstance(event, FinishEvent) and ids == [7, 8, 9, 10, 11]
        assert line(h)["decode_start"] == "wait" and "fallback" not in line(h)
        assert line(h)["admission_wait_s"] >= 0.3 and fallback_count(h, "fail") == 0
        assert not h.backend.live
        h.backend.router.assert_no_leaks()

    asyncio.run(main())


def test_a_prompt_that_queued_at_its_prefill_worker_past_the_ttft_target_waits_for_its_kv():
    """Routed at once, but the prefill worker's queue held the prompt longer than the TTFT
    target (the load-shift study's fixed pair: TTFT 80-200 s against a 17 s target). Its first
    token says the prefill is spent and the transfer's last leg runs: the wait counts from there,
    so decode starts when the K/V publishes instead of failing `kv_not_visible` (d0 has no room
    for a recompute beside the reservation)."""

    async def main():
        h = harness(["p0"], ["d0"], ttft_slo_s=0.3)
        h.backend.report_load(m.Heartbeat("d0", 1, m.Load(0, 0, 0, 2, 0, 0, 1000)))  # room for this request only
        task = asyncio.create_task(collect(h.backend, "r"))
        _, reserve = await h.next_sent(m.ReserveKv)
        await h.deliver(m.Reserved("d0", 1, "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        await h.next_sent(m.Prefill)
        await asyncio.sleep(0.4)  # queued behind other prompts at p0, past the TTFT target
        await h.deliver(m.Tokens("p0", 1, (m.TokenItem("r", (7,), "", False, None, len(PROMPT), 0, prefilled=True),)))
        wid, _ = await h.next_sent(m.StartDecode)
        assert wid == "d0" and not task.done() and "Generate" not in h.sent_kinds()
        await h.deliver(m.TransferDone("d0", 1, "r", reserve.transfer_id, reserve.generation, "destination", True))
        await h.deliver(m.Tokens("d0", 1, (m.TokenItem("r", (8, 9, 10, 11), "", True, "length", len(PROMPT), 0),)))
        ids, event = await task
        assert isinstance(event, FinishEvent) and ids == [7, 8, 9, 10, 11]
        assert line(h)["decode_start"] == "wait" and "fallback" not in line(h) and line(h)["ttft_s"] >= 0.4
        h.backend.router.assert_no_leaks()

    asyncio.run(main())
