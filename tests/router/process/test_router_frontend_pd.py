"""The router backend's local-prefill path (the P/D decision chose no handoff), no processes:
Generate goes to the chosen decode worker with its one hold, nothing is reserved or prefilled
elsewhere, the decision and its reason are on the trace line and in the metric, and a decode
worker lost mid-request recomputes the request on another one."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from pdserve.router.policy.pd_decision import PdPolicy
from pdserve.workers import messages as m
from tests.router.process.test_router_frontend import PROMPT, Harness, collect, finish


def harness(mode: str, prefill: list[str], decode: list[str]) -> Harness:
    h = Harness(prefill, decode)
    h.backend.router.config = replace(h.backend.router.config, pd=PdPolicy(mode))
    return h


def test_a_local_prefill_runs_whole_on_the_decode_worker():
    async def main():
        h = harness("never", ["p0"], ["d0"])
        task = asyncio.create_task(collect(h.backend, "r"))
        wid, generate = await h.next_sent(m.Generate)
        assert wid == "d0" and generate.request_id == "r" and generate.grant_seq > 0
        assert not {"ReserveKv", "Prefill"} & set(h.sent_kinds())
        done = m.TokenItem("r", (7, 8, 9, 10, 11), "", True, "length", len(PROMPT), 0)
        await h.deliver(m.Tokens("d0", 1, (done,)))
        await finish(h, task)
        line = h.backend.trace.recent[-1]
        assert (line["prefill"], line["decode"], line["pd_decision"], line["pd_reason"]) == ("d0", "d0", "local", "never")
        assert 'pdserve_pd_decisions_total{decision="local"} 1.0' in h.backend.metrics_text().decode()

    asyncio.run(main())


def test_a_lost_decode_worker_recomputes_a_local_prefill_elsewhere():
    async def main():
        h = harness("never", ["p0"], ["d0", "d1"])
        task = asyncio.create_task(collect(h.backend, "r"))
        first, _ = await h.next_sent(m.Generate)
        await h.kill(first)
        target, generate = await h.next_sent(m.Generate)
        assert target == ({"d0", "d1"} - {first}).pop() and generate.request_id != "r"
        done = m.TokenItem(generate.request_id, (7, 8, 9, 10, 11), "", True, "length", len(PROMPT), 0)
        await h.deliver(m.Tokens(target, 1, (done,)))
        await finish(h, task)

    asyncio.run(main())
