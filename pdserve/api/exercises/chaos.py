"""`pdserve chaos`: steady load over HTTP while workers are killed with kill -9 or stopped with
SIGSTOP, then a tally.

Contract: `run_chaos(config, spec)` serves `config` on a free local port, sends seeded streaming
requests at `spec.rate` req/s (at most `spec.max_in_flight` open) for `spec.duration_s`, and every
`spec.kill_every_s` strikes a random live worker with the next fault of `spec.faults` in turn:
"kill" (SIGKILL, no warning) or "stop" (SIGSTOP, and SIGCONT `spec.stop_s` later: past the
router's heartbeat timeout the worker is retired, ended and restarted; within it, it resumes).
Each request ends in exactly one class:
  completed    the stream delivered max_tokens tokens and [DONE];
  error        an explicit end: an HTTP error status, an error event in the stream, or a
               finish short of max_tokens that says why (finish_reason "abort");
  hung         no event for `spec.hang_s` (the client gives up on it);
  cut          the stream ended without its length and without saying why.
After the load it waits for every worker to be back (supervision) and idle, then reports leaked
blocks (a worker whose pool is not all free, or fails its integrity check), router holds still
open, restarts, workers FAILED by the crash-loop limit, and whether every killed worker (and every
one stopped past the heartbeat timeout) came back under a newer epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field, replace

import httpx

from pdserve.api.server import ServeConfig, cluster, model_name
from pdserve.bench.http.sse import sse_lines
from pdserve.ports import free_local_port

CLASSES = ("completed", "error", "hung", "cut")
FAULTS = ("kill", "stop")


@dataclass(frozen=True)
class ChaosSpec:
    duration_s: float = 600.0
    kill_every_s: float = 20.0
    rate: float = 1.0  # requests per second, Poisson
    max_in_flight: int = 16
    min_prompt: int = 16
    max_prompt: int = 256
    min_output: int = 8
    max_output: int = 48
    hang_s: float = 60.0
    settle_s: float = 180.0  # after the load: how long workers may take to be back and idle
    seed: int = 0
    faults: tuple[str, ...] = ("kill", "stop")  # struck in turn, one every kill_every_s
    stop_s: float = 15.0  # a stopped worker gets SIGCONT this much later

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.kill_every_s <= 0 or self.rate <= 0 or self.max_in_flight < 1:
            raise ValueError("duration, kill interval and rate must be > 0, max_in_flight >= 1")
        if not self.faults or set(self.faults) - set(FAULTS) or self.stop_s <= 0:
            raise ValueError(f"faults must be some of {FAULTS} and stop_s > 0, got {self.faults}, {self.stop_s}")


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    errors: dict[str, int] = field(default_factory=dict)
    kills: list[tuple[float, str]] = field(default_factory=list)  # kill -9
    stops: list[tuple[float, str]] = field(default_factory=list)  # SIGSTOP, SIGCONT stop_s later

    def add(self, kind: str, detail: str | None = None) -> None:
        self.counts[kind] += 1
        if detail:
            key = detail[:80]
            self.errors[key] = self.errors.get(key, 0) + 1


def classify_stream(lines: list[str], max_tokens: int) -> tuple[str, str | None]:
    """SSE lines of one completed HTTP stream -> (class, detail). Pure, for tests."""
    ids, finish, done = 0, None, False
    for line in lines:
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            try:
                chunk = json.loads(line[6:])
            except json.JSONDecodeError:
                return "cut", "malformed data line"
            if "error" in chunk:
                return "error", str(chunk["error"].get("code") or chunk["error"].get("message"))
            for choice in chunk.get("choices", []):
                ids += len(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
    if ids == max_tokens and done:
        return "completed", None
    if finish not in (None, "length", "stop"):
        return "error", f"finish_reason={finish}"
    return "cut", f"{ids}/{max_tokens} tokens, finish={finish}, done={done}"


async def _one(client: httpx.AsyncClient, url: str, body: dict, hang_s: float, tally: Tally) -> None:
    lines: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                tally.add("error", f"HTTP {resp.status_code}")
                return
            stream = sse_lines(resp.aiter_bytes())
            while True:
                try:
                    line = await asyncio.wait_for(anext(stream), timeout=hang_s)
                except StopAsyncIteration:
                    break
                if line:
                    lines.append(line)
    except asyncio.TimeoutError:
        tally.add("hung", f"silent {hang_s:.0f}s after {len(lines)} lines")
        return
    except httpx.HTTPError as exc:
        tally.add("cut", f"transport: {type(exc).__name__}")
        return
    tally.add(*classify_stream(lines, body["max_tokens"]))


def _body(rng: random.Random, spec: ChaosSpec, vocab: int, model: str, i: int) -> dict:
    n = rng.randint(spec.min_prompt, spec.max_prompt)
    return {"model": model, "prompt": [rng.randrange(3, min(vocab, 256)) for _ in range(n)],
            "max_tokens": rng.randint(spec.min_output, spec.max_output), "ignore_eos": True, "stream": True,
            "return_token_ids": True, "seed": 7000 + i, "temperature": 0.0 if i % 2 else 0.7}


async def _load(url: str, spec: ChaosSpec, vocab: int, model: str, tally: Tally) -> None:
    rng = random.Random(spec.seed)
    slots = asyncio.Semaphore(spec.max_in_flight)
    tasks, end, i = [], time.monotonic() + spec.duration_s, 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(spec.rate))
            await slots.acquire()
            body = _body(rng, spec, vocab, model, i)
            task = asyncio.create_task(_one(client, url, body, spec.hang_s, tally))
            task.add_done_callback(lambda _t: slots.release())
            tasks.append(task)
            i += 1
        await asyncio.gather(*tasks)


async def _killer(backend, launcher, spec: ChaosSpec, tally: Tally, t0: float) -> None:
    """A fault every `kill_every_s` while requests still arrive; none while the last ones drain."""
    rng = random.Random(spec.seed + 1)
    resumes, n = [], 0
    try:
        while time.monotonic() + spec.kill_every_s < t0 + spec.duration_s:
            await asyncio.sleep(spec.kill_every_s)
            live = sorted(w.id for w in backend.workers() if w.state != "failed")
            if not live:
                continue
            victim, fault = rng.choice(live), spec.faults[n % len(spec.faults)]
            n += 1
            at = round(time.monotonic() - t0, 1)
            if fault == "kill":
                launcher.kill(victim)
                tally.kills.append((at, victim))
            else:
                pid = launcher.pid(victim)
                os.kill(pid, signal.SIGSTOP)
                tally.stops.append((at, victim))
                resumes.append(asyncio.create_task(_resume(pid, spec.stop_s)))
        await asyncio.gather(*resumes)
    finally:
        for task in resumes:
            task.cancel()


async def _resume(pid: int, after_s: float) -> None:
    """SIGCONT a stopped worker (if the supervisor has not ended it meanwhile), also when cancelled."""
    try:
        await asyncio.sleep(after_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def _settle(backend, killed: set[str], first_epoch: dict[str, int], timeout_s: float) -> dict:
    """Wait until every worker in `killed` is back under a newer epoch and every pool is idle
    (a FAILED worker has no pool: it is reported, and counts as not replaced)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = backend.workers()
        failed = sorted(w.id for w in rows if w.state == "failed")
        views = {w.id: w for w in rows if w.state != "failed"}
        back = not failed and all(w in views and views[w].epoch > first_epoch[w] for w in killed)
        idle = [v for v in views.values() if v.load and v.load["num_running"] == 0 and v.load["reserved_blocks"] == 0
                and v.load["free_blocks"] == v.load["num_blocks"] and v.load["integrity_ok"]]
        if (back and len(idle) == len(first_epoch) and not backend.live) or time.monotonic() > deadline:
            leaked = {wid: v.load for wid, v in views.items() if v not in idle}
            return {"all_replaced": back, "workers_back": len(views), "leaked_workers": leaked, "failed_workers": failed,
                    "epochs": {wid: v.epoch for wid, v in sorted(views.items())}, "requests_still_live": len(backend.live)}
        await asyncio.sleep(0.2)


async def run_chaos(config: ServeConfig, spec: ChaosSpec) -> dict:
    import uvicorn

    from pdserve.api.app import create_app
    from pdserve.model.config import load_config
    from pdserve.model.default import resolve_model

    vocab, model, port, tally = load_config(resolve_model(config.engine.model)).vocab_size, model_name(config), free_local_port(), Tally()
    async with cluster(replace(config, port=port)) as (backend, launcher):
        server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        first_epoch = {w.id: w.epoch for w in backend.workers()}
        t0 = time.monotonic()
        killer = asyncio.create_task(_killer(backend, launcher, spec, tally, t0))
        await _load(f"http://127.0.0.1:{port}/v1/completions", spec, vocab, model, tally)
        await killer  # strikes ended before the last requests; this waits out the last SIGCONT
        hung_past_timeout = spec.stop_s > config.heartbeat_timeout_s  # retired, ended and restarted
        replaced = {v for _, v in tally.kills} | ({v for _, v in tally.stops} if hung_past_timeout else set())
        settled = await _settle(backend, replaced, first_epoch, spec.settle_s)
        holds_ok = _router_clean(backend)
        server.should_exit = True
        await serving
        restarts = launcher.num_restarts
    total = sum(tally.counts.values())
    return {"requests": total, **tally.counts, "completed_ratio": tally.counts["completed"] / total if total else 0.0,
            "kills": len(tally.kills), "stops": len(tally.stops), "restarts": restarts, "router_holds_clean": holds_ok,
            **settled, "kill_log": tally.kills, "stop_log": tally.stops, "stop_s": spec.stop_s, "error_kinds": dict(sorted(tally.errors.items(), key=lambda kv: -kv[1])[:8]),
            "duration_s": spec.duration_s, "kill_every_s": spec.kill_every_s, "rate": spec.rate}


def _router_clean(backend) -> bool:
    try:
        backend.router.assert_no_leaks()
    except AssertionError:
        return False
    return True
