"""Truthful metrics on a live 1P1D cluster (tiny model): the router's /metrics text passes the
ledger's runtime-release check, the logical-bytes counter equals the bytes of the manifests the
workers published (read back from their own handoff traces), physical bytes are at least that,
and each request's trace line records both its first-token and its K/V-published time."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.errors import CAPABILITY_DENIALS
from pdserve.ledger.checks import load_fixture, run_check
from pdserve.ledger.checks.runtime_release import with_exposed_metrics
from pdserve.ledger.trace import parse_jsonl
from tests.router.process.test_router_metrics import sample
from tests.runtime.conftest import collect, config, prompt, wait_baseline


def published_manifest_bytes(trace_dir: str) -> tuple[int, list]:
    """(sum over published transfers of their chunks' bytes at the destination, every handoff event)."""
    paths = [p for p in glob.glob(os.path.join(trace_dir, "*.jsonl"))
             if not p.endswith((".steps.jsonl", "requests.jsonl"))]
    events = parse_jsonl(line for path in sorted(paths) for line in open(path))
    published = {e.transfer for e in events if e.event == "publish"}
    visible = {(e.transfer, e.chunk): e.nbytes for e in events if e.event == "chunk_visible" and e.transfer in published}
    return sum(visible.values()), events


async def settled_metrics(backend, transfers: int, timeout_s: float = 30.0) -> str:
    """The metrics text once the sources' TransferDone reports of `transfers` published transfers
    are in (they follow publication; each observes the exposed-time histogram once). The workers'
    handoff traces are compared with it after the cluster stops: a running worker's trace file
    is not flushed yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = backend.metrics_text().decode()
        if sample(text, "pdserve_kv_transfer_exposed_seconds_count") == transfers or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.1)


def test_live_metrics_pass_the_release_check_and_count_the_manifests_bytes(tmp_path):
    trace_dir = str(tmp_path)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [prompt(n, 60 + i) for i, n in enumerate((20, 300, 33))]

    async def main():
        async with cluster(config(trace_dir=trace_dir)) as (backend, launcher):
            results = await asyncio.gather(*(collect(backend, f"m{i}", p, params) for i, p in enumerate(prompts)))
            results.append(await collect(backend, "m3", prompts[1], params))  # again: D may hold its prefix now
            assert all(isinstance(event, FinishEvent) for _, event in results)
            await wait_baseline(backend)
            return await settled_metrics(backend, len(results)), list(backend.trace.recent), launcher.impl.procs

    text, lines, procs = asyncio.run(main())
    # each worker closed before it exited (workers/main.py exits without finalization): status 0,
    # its K/V segment unlinked, and its handoff trace complete (read below)
    assert {wid: p.returncode for wid, p in procs.items()} == {"prefill-0": 0, "decode-0": 0}
    assert [n for n in os.listdir("/dev/shm") if any(n.startswith(f"pdserve-{w}-{p.pid}") for w, p in procs.items())] == []
    logical, events = published_manifest_bytes(trace_dir)
    run_check("runtime-release", with_exposed_metrics(load_fixture("runtime-release"), text))
    assert logical > 0 and sample(text, "pdserve_kv_transfer_bytes_total") == logical
    assert sample(text, "pdserve_kv_transfer_physical_bytes_total") >= logical
    assert sample(text, "pdserve_kv_transfer_attempts_total") == 4
    assert sample(text, "pdserve_kv_transfer_retries_total") == sum(e.event == "retry" for e in events)
    assert sample(text, "pdserve_kv_transfer_exposed_seconds_count") == 4
    assert sample(text, "pdserve_workers_live", 'role="prefill"') == sample(text, "pdserve_workers_live", 'role="decode"') == 1
    assert sample(text, "pdserve_slo_attainment", 'clock="ttft"') is not None
    assert sample(text, "pdserve_rollback_seconds_count") == 0
    assert [sample(text, "pdserve_capability_denials_total", f'reason="{r.value}"') for r in CAPABILITY_DENIALS] \
        == [0] * len(CAPABILITY_DENIALS)  # capabilities are on, and every transfer's verified
    assert all(e.attempt >= 1 for e in events if e.request != "?")  # attempts count from 1 everywhere
    assert len(lines) == 4 and all(r["ttft_s"] is not None and r["kv_published_s"] is not None for r in lines)
    with open(os.path.join(trace_dir, "requests.jsonl")) as f:
        assert all("kv_published_s" in json.loads(line) for line in f)
