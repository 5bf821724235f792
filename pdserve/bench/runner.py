"""Replaying a workload open-loop against an endpoint.

Contract: each request is sent at its scheduled `arrival_s` after the run starts, whether or not
earlier ones have finished (open loop), over one shared connection pool with no connection limit;
with `max_concurrency` N a request due while N are in flight waits for one of them to end (with
rate inf: a closed loop of N clients, as `vllm bench serve --max-concurrency`; its TTFT counts from
the moment it is sent, its `start_s`). Every request yields exactly one record, in request order. The progress bar goes to stderr and is
off when `quiet` or when stderr is not a terminal. During a replay the objects that exist before it
(the workload, prompts, imported modules) are moved out of the garbage collector's view
(`gc.freeze`), so a full collection does not pause the loop mid-run and delay timestamps.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.http.client import EndpointConfig, make_transport_for, send_request
from pdserve.bench.records import RequestRecord
from pdserve.bench.http.transport import Transport
from pdserve.bench.workload import BenchRequest
from pdserve.loop import run as run_loop
from pdserve.heap import frozen_heap


@dataclass(frozen=True)
class RunResult:
    """The records of one replay, its wall time, and how late the client sent at worst."""

    records: tuple[RequestRecord, ...]
    wall_s: float
    max_send_lag_s: float


async def run_requests(
    requests: Sequence[BenchRequest],
    endpoint: EndpointConfig,
    quiet: bool = True,
    transport: Transport | None = None,
    label: str = "",
    max_concurrency: int | None = None,
) -> RunResult:
    """Send every request at its arrival time (and a free slot of `max_concurrency`); wait for all of them."""
    own_transport = transport is None
    transport = transport or make_transport_for(endpoint)
    bar = _progress_bar(len(requests), quiet, label)
    try:
        with frozen_heap():
            records, wall_s = await _replay(transport, requests, endpoint, bar, max_concurrency)
    finally:
        if bar is not None:
            bar.close()
        if own_transport:
            await transport.aclose()
    lags = [r.start_s - r.arrival_s for r in records if r.start_s is not None]
    return RunResult(records=records, wall_s=wall_s, max_send_lag_s=max(lags, default=0.0))


def run_requests_sync(requests: Sequence[BenchRequest], endpoint: EndpointConfig, quiet: bool = True, label: str = "",
                      max_concurrency: int | None = None) -> RunResult:
    """`run_requests` on a fresh event loop."""
    return run_loop(run_requests(requests, endpoint, quiet=quiet, label=label, max_concurrency=max_concurrency))


async def _replay(transport, requests, endpoint, bar, max_concurrency=None) -> tuple[tuple[RequestRecord, ...], float]:
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    tasks: list[asyncio.Task | None] = [None] * len(requests)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start_s = time.perf_counter()
    for i in order:
        delay_s = start_s + requests[i].arrival_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if slots is not None:
            await slots.acquire()
        task = asyncio.create_task(send_request(transport, requests[i], endpoint, start_s))
        if slots is not None:
            task.add_done_callback(lambda _: slots.release())
        if bar is not None:
            task.add_done_callback(lambda _: bar.update(1))
        tasks[i] = task
    records = await asyncio.gather(*tasks)
    return tuple(records), time.perf_counter() - start_s


def _progress_bar(total: int, quiet: bool, label: str):
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, desc=label or "requests", unit="req", leave=False)
