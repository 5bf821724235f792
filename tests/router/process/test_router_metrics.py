"""The router's /metrics tell the truth (router/process/metrics.py), driven with typed worker messages and
no worker processes: every name the ledger's runtime-release check requires is exposed, bytes
are the workers' reported bytes (not the router's plan), resends, live workers and SLO
attainment are updated, and the trace line keeps first-token and K/V-published times apart."""

from __future__ import annotations

import asyncio
import math
import re

from pdserve.ledger.checks import load_fixture, run_check
from pdserve.ledger.checks.runtime_release import REQUIRED_METRICS, exposed_metric_names, with_exposed_metrics
from pdserve.router.process.inflight import RequestTraceWriter
from pdserve.router.process.metrics import RuntimeMetrics
from pdserve.workers import messages as m
from tests.router.process.test_router_frontend import PROMPT, Harness, collect, finish


def sample(text: str, name: str, labels: str = "") -> float | None:
    """The value of one sample line (`name{labels} value`) in a Prometheus text, or None."""
    found = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}' if labels else '')} (\S+)$", text, re.M)
    return None if found is None else float(found.group(1))


def test_a_fresh_registry_exposes_every_name_the_runtime_release_check_requires():
    text = RuntimeMetrics().text().decode()
    assert REQUIRED_METRICS <= exposed_metric_names(text)
    run_check("runtime-release", with_exposed_metrics(load_fixture("runtime-release"), text))


def test_bytes_resends_and_trace_times_come_from_the_workers_reports():
    """A 1P1D request: the byte counters take the source's logical (manifest) and physical bytes,
    not the router's planned bytes; resends count as retries; the trace line has both clocks."""

    async def main():
        h = Harness(["p0"], ["d0"])
        task = asyncio.create_task(collect(h.backend, "r"))
        _, reserve = await h.next_sent(m.ReserveKv)
        await h.deliver(m.Reserved("d0", 1, "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        _, prefill = await h.next_sent(m.Prefill)
        await h.deliver(m.Tokens("p0", 1, (m.TokenItem("r", (7,), "", False, None, len(PROMPT), 0, prefilled=True),)))
        await h.next_sent(m.StartDecode)
        await h.deliver(m.TransferDone("d0", 1, "r", reserve.transfer_id, reserve.generation, "destination", True))
        await h.deliver(m.TransferDone("p0", 1, "r", reserve.transfer_id, reserve.generation, "source", True,
                                       logical_bytes=4096, physical_bytes=5000, transfer_s=0.01, resends=3))
        await h.deliver(m.Tokens("d0", 1, (m.TokenItem("r", (8, 9, 10, 11), "", True, "length", len(PROMPT), 0),)))
        await finish(h, task)
        return h

    h = asyncio.run(main())
    text = h.backend.metrics_text().decode()
    assert sample(text, "pdserve_kv_transfer_bytes_total") == 4096
    assert sample(text, "pdserve_kv_transfer_physical_bytes_total") == 5000
    assert sample(text, "pdserve_kv_transfer_retries_total") == 3
    assert sample(text, "pdserve_kv_transfer_attempts_total") == 1
    assert sample(text, "pdserve_kv_transfer_exposed_seconds_count") == 1
    line = h.backend.trace.recent[-1]
    assert line["ttft_s"] is not None and line["kv_published_s"] is not None
    assert line["kv_bytes"] == 4096 and line["kv_physical_bytes"] == 5000 and line["kv_resends"] == 3
    assert sample(text, "pdserve_slo_attainment", 'clock="joint"') == 1.0  # default 2 s / 0.1 s targets, no wall clock spent


def test_an_aborted_transfer_counts_its_wire_bytes_but_no_logical_bytes():
    async def main():
        h = Harness(["p0"], ["d0"])
        task = asyncio.create_task(collect(h.backend, "r"))
        _, reserve = await h.next_sent(m.ReserveKv)
        await h.deliver(m.Reserved("d0", 1, "r", reserve.transfer_id, True, None, (0, 1), 0, "res"))
        await h.next_sent(m.Prefill)
        await h.deliver(m.TransferDone("p0", 1, "r", reserve.transfer_id, reserve.generation, "source", False,
                                       reason="transport_failure", logical_bytes=4096, physical_bytes=700, resends=1))
        text = h.backend.metrics_text().decode()
        task.cancel()
        return text

    text = asyncio.run(main())
    assert sample(text, "pdserve_kv_transfer_bytes_total") == 0
    assert sample(text, "pdserve_kv_transfer_physical_bytes_total") == 700
    assert sample(text, "pdserve_kv_transfer_retries_total") == 1


def test_workers_live_follows_registrations_and_retirements():
    async def main():
        h = Harness(["p0"], ["d0", "d1"])
        before = h.backend.metrics_text().decode()
        await h.kill("d1")
        return before, h.backend.metrics_text().decode()

    before, after = asyncio.run(main())
    assert [sample(before, "pdserve_workers_live", f'role="{r}"') for r in ("prefill", "decode", "colocated")] == [1, 2, 0]
    assert sample(after, "pdserve_workers_live", 'role="decode"') == 1


def test_slo_attainment_counts_errors_as_misses_and_leaves_client_aborts_out():
    trace = RequestTraceWriter(None)
    for rec in ({"finish_reason": "length", "ttft_s": 0.5, "tpot_s": 0.05},   # meets both
                {"finish_reason": "stop", "ttft_s": 3.0, "tpot_s": None},     # misses TTFT; one token: no TPOT to miss
                {"finish_reason": "error", "ttft_s": 0.1, "tpot_s": 0.01},    # an error misses both
                {"finish_reason": "abort", "ttft_s": 9.0, "tpot_s": 9.0},     # the client left: not counted
                {"request_id": "x", "rejected": "no_decode_capacity"}):       # rejected early: not a finished request
        trace.write(rec)
    ttft, tpot = trace.clock_samples()
    assert ttft == [0.5, 3.0, math.inf] and tpot == [0.05, 0.0, math.inf]
    text = RuntimeMetrics(clock_samples=trace.clock_samples, slo_s=(2.0, 0.1)).text().decode()
    got = {c: sample(text, "pdserve_slo_attainment", f'clock="{c}"') for c in ("ttft", "tpot", "joint")}
    assert got == {"ttft": 1 / 3, "tpot": 2 / 3, "joint": 1 / 3}
