"""One in-flight request as the router process sees it, and its per-request trace record.

Contract: `InFlight` holds the request's route, its events on their way to the client (`outputs`,
output_collector.py), which workers may speak for it right now
(`owners`: messages from anyone else are late and ignored), the tokens streamed so far (the
recompute fallback resumes from them), and the timestamps its trace line reports. The line keeps
two clocks apart: `ttft_s` is when the first token was sent to the client (TTFT; the prefill
worker's first token is never held back for publication) and `kv_published_s` when the decode
worker published the K/V (None without a handoff), both from arrival. In disaggregated mode it
also records the request's P/D decision (`pd_decision`: disaggregate or local, `pd_reason`, and
when the margin decided, its four terms `pd_interference_saved_s`, `pd_transfer_exposed_s`,
`pd_route_delta_s`, `pd_failure_penalty_s`, with `pd_net_margin_s`, both gates and the targets it
read, `pd_ttft_slo_s` and `pd_tpot_slo_s`). `cached_tokens`: the prompt tokens the serving worker
reused (its prefix cache, host tier, or a fetched prefix), what the response's usage reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

from pdserve.router.contract import GenerationRequest
from pdserve.router.process.output_collector import OutputCollector


@dataclass
class InFlight:
    req: GenerationRequest
    seed: int
    outputs: OutputCollector  # events for the client: merged while it lags, never back-pressuring the worker
    arrival_s: float = field(default_factory=time.monotonic)
    transfer_start_s: float | None = None  # when the router handed the prompt to P with its transfer plan
    policy: str = ""
    prefill_id: str = ""
    decode_id: str = ""
    generation: int = 0
    transfer_id: str = ""
    owners: set[str] = field(default_factory=set)
    output_ids: list[int] = field(default_factory=list)
    reserved: asyncio.Future | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    published: bool = False
    kv_failed: bool = False
    draining: bool = False  # the rollback's drain is cancelling this attempt: it alone moves the request
    started_decode: bool = False
    done: bool = False
    trace: dict = field(default_factory=dict)
    engine_id: str = ""  # the id workers know this attempt by (request id, or id#gN after a retry)
    forks: tuple[tuple[int, int], ...] = ()  # n > 1: the sequences the prefill worker handed on (StartDecode)
    restart_wait_until_s: float | None = None  # waiting for a decode worker being restarted until then (recovery.py)

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or self.req.request_id

    @property
    def disaggregated(self) -> bool:
        return self.prefill_id != self.decode_id

    def start_transfer(self, prefill_id: str, decode_id: str) -> None:
        """The prefill work and its K/V transfer begin: both workers own the request now."""
        self.owners = {prefill_id, decode_id}
        self.transfer_start_s = time.monotonic()

    def wait_clock_s(self) -> float:
        """Where the decode-start wait budget counts from (router/process/recovery.py): the prefill's end
        (its first token: the prompt's work is spent and the transfer's last leg runs), else the
        transfer's start, else arrival. Time queued in admission or in the prefill worker's queue
        is never held against a K/V that is already on its way."""
        for start in (self.first_token_s, self.transfer_start_s):
            if start is not None:
                return start
        return self.arrival_s

    def note(self, **fields) -> None:
        self.trace.update(fields)

    def bump(self, key: str) -> None:
        self.trace[key] = self.trace.get(key, 0) + 1

    def record(self, finish_reason: str) -> dict:
        now = time.monotonic()
        ttft = None if self.first_token_s is None else self.first_token_s - self.arrival_s
        n = len(self.output_ids)
        tpot = (now - self.first_token_s) / (n - 1) if self.first_token_s is not None and n > 1 else None
        return {
            "request_id": self.req.request_id, "policy": self.policy, "prefill": self.prefill_id, "decode": self.decode_id,
            "prompt_tokens": len(self.req.prompt_ids), "output_tokens": n, "ttft_s": ttft, "tpot_s": tpot,
            "kv_published_s": self.trace.get("kv_published_s"), "pd_decision": self.trace.get("pd_decision"),
            "e2e_s": now - self.arrival_s, "finish_reason": finish_reason, "generation": self.generation,
            "reroutes": self.trace.get("reroutes", 0), "retries": self.trace.get("retries", 0), **self.trace,
        }


class RequestTraceWriter:
    """Appends one JSON line per finished (or rejected) request; keeps the last `keep` in memory."""

    def __init__(self, path: str | None, keep: int = 10_000):
        self._file = open(path, "a", buffering=1) if path else None
        self.recent: list[dict] = []
        self._keep = keep

    def write(self, record: dict) -> None:
        self.recent.append(record)
        del self.recent[: -self._keep]
        if self._file is not None:
            self._file.write(json.dumps(record, default=str) + "\n")

    def values(self, key: str) -> list:
        return [r[key] for r in self.recent if r.get(key) is not None]

    def clock_samples(self) -> tuple[list[float], list[float]]:
        """(TTFT s, TPOT s) of each recent finished request, for SLO attainment: one that ended in
        an error misses both clocks, one the client aborted is left out, a one-token answer has
        no TPOT to miss."""
        ttft, tpot = [], []
        for r in self.recent:
            reason = r.get("finish_reason")
            if reason is None or reason == "abort":
                continue
            failed = reason == "error" or r.get("ttft_s") is None
            ttft.append(math.inf if failed else r["ttft_s"])
            tpot.append(math.inf if failed else r.get("tpot_s") or 0.0)
        return ttft, tpot

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
