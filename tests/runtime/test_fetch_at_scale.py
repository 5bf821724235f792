"""Cross-worker prefix fetch at scale, through the served runtime (tiny model, 2-replica
colocated, round robin: after the first conversation on colocated-0, every other request lands on
colocated-1, which lacks the history): concurrent requests for one prefix to one destination make
exactly one fetch, the others wait on it (router/kv/fetch_runner.py), and its messages go to the
workers' fetch sockets (workers/prefix_fetch/fetch_control.py); a fetch held up longer than
the workers' lease lands because the router renews fetch leases as it renews request leases; a
request that joined a fetch which then fails recomputes its prefix."""

from __future__ import annotations

import asyncio
import re
import time

import msgspec

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.router.kv import fetch_runner
from pdserve.workers import messages as m
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline
from tests.runtime.test_kv_index_runtime import until

HISTORY = prompt(96, 11)  # six full blocks
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _recording(backend, delay_s: dict | None = None, rewrite: dict | None = None,
               hold: dict | None = None) -> list:
    """Test wrapper on the router's sends: records (worker, message type); `delay_s` holds a
    message type's sends back that long first (a slow fetch path); `hold` maps a message type to an
    asyncio.Event its sends wait for (held until the test sets it); `rewrite` maps a message type
    to a function that alters it on its way (a forged plan)."""
    sent, original = [], backend._send

    async def send(worker_id, msg):
        sent.append((worker_id, type(msg).__name__))
        await asyncio.sleep((delay_s or {}).get(type(msg), 0.0))
        if (release := (hold or {}).get(type(msg))) is not None:
            await release.wait()
        return await original(worker_id, (rewrite or {}).get(type(msg), lambda x: x)(msg))

    backend._send = send
    return sent


async def _history_on_w0(backend) -> list[int]:
    first, event = await collect(backend, "t1", HISTORY, PARAMS)
    assert isinstance(event, FinishEvent)
    keys = backend._block_hashes(HISTORY)
    await until(lambda: all(backend.router.kv_holders(k) for k in keys))
    return first


def test_concurrent_requests_for_one_prefix_make_one_fetch_and_tokens_match():
    suffixes = [prompt(20, 100 + i) for i in range(6)]

    async def main():
        async with cluster(config(mode="colocated", replicas=2, policy="round_robin")) as (backend, _):
            first = await _history_on_w0(backend)
            sent = _recording(backend)
            prompts = [HISTORY + tuple(first) + s for s in suffixes]
            results = await asyncio.gather(*(collect(backend, f"c{i}", p, PARAMS) for i, p in enumerate(prompts)))
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            lines = {line["request_id"]: line for line in backend.trace.recent}
            return first, prompts, results, sent, lines, backend.metrics_text().decode()

    first, prompts, results, sent, lines, text = asyncio.run(main())
    planned = [rid for rid, line in lines.items() if rid.startswith("c") and line.get("fetch") == "fetch"]
    assert len(planned) == 3  # the three requests round robin sends to colocated-1
    assert [kind for _, kind in sent].count("FetchReserve") == 1  # one fetch for all three
    assert [kind for _, kind in sent].count("FetchPin") == 1
    fetch_ids = {wid for wid, kind in sent if kind.startswith("Fetch")}  # off the engine-step thread (fetch_control.py)
    assert fetch_ids == {"colocated-0#fetch", "colocated-1#fetch"}
    assert _metric(text, 'pdserve_kv_fetches_total{result="landed"}') == 1
    assert _metric(text, "pdserve_kv_fetch_waits_total") == 2
    assert sum(1 for rid in planned if lines[rid].get("fetch_joined")) == 2
    for rid in planned:  # the waiters prefill over what the one fetch landed
        assert lines[rid]["fetch_landed_blocks"] == 6 and lines[rid]["cached_tokens"] >= 96
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    for p, (tokens, event) in zip(prompts, results):
        assert isinstance(event, FinishEvent)
        assert tokens == list(alone.generate([list(p)], PARAMS)[0].output_ids)


def test_a_fetch_held_longer_than_the_lease_lands_because_the_router_renews_it(monkeypatch):
    """Leases of 0.6 s; the router holds the holder's FetchServe back for 2 s after both sides
    took the fetch's lease (the destination's reservation, the holder's pins): renewed every
    0.2 s, neither expires and the six blocks land; unrenewed, both sides drop the fetch. The
    fetch's own deadline (which bounds the whole fetch) is raised past the hold."""
    monkeypatch.setattr(fetch_runner, "MIN_DEADLINE_S", 20.0)

    async def main():
        cfg = config(mode="colocated", replicas=2, policy="round_robin", lease_s=0.6)
        async with cluster(cfg) as (backend, _):
            first = await _history_on_w0(backend)
            sent = _recording(backend, {m.FetchServe: 2.0})
            turn2 = HISTORY + tuple(first) + prompt(20, 12)
            second, event = await collect(backend, "t2", turn2, PARAMS)
            assert isinstance(event, FinishEvent)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            lines = {line["request_id"]: line for line in backend.trace.recent}
            return turn2, second, sent, lines["t2"]

    turn2, second, sent, t2 = asyncio.run(main())
    assert (t2["fetch"], t2["fetch_landed_blocks"]) == ("fetch", 6) and "fetch_failure" not in t2
    assert t2["cached_tokens"] >= 96 and t2["fetch_s"] > 2.0
    renewed = {wid for wid, kind in sent if kind == "RenewLeases"}
    assert renewed == {"colocated-0", "colocated-1"}  # holder and destination (no request lease in colocated)
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    assert second == list(alone.generate([list(turn2)], PARAMS)[0].output_ids)


LONG_HISTORY = prompt(128, 13)  # eight full blocks
JOIN_TIMEOUT_S = 60.0  # only a bound that fails a run where c2 never joins; the hold ends on the join itself


async def _joined(backend, waits: int) -> None:
    """Once the router counted `waits` requests waiting on a running fetch (fetch_runner.py counts
    one as it decides to join, before it waits); fails the test after JOIN_TIMEOUT_S."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while _metric(backend.metrics_text().decode(), "pdserve_kv_fetch_waits_total") < waits:
        assert time.monotonic() < deadline, f"no request joined the running fetch in {JOIN_TIMEOUT_S} s"
        await asyncio.sleep(0.05)


def _shorter_then_longer(rewrite: dict | None = None):
    """Round robin: t1 (colocated-0) caches 8 blocks; c1 (colocated-1) fetches the first 6 with its
    FetchServe held back (and altered by `rewrite`); f (colocated-0) passes; c2 (colocated-1)
    wants all 8 while c1's fetch runs. c1's FetchServe is released once the router counted c2 as
    waiting on that fetch (an event, not a timer: however long f takes, c2 finds c1's fetch
    running). Returns the prompts, c1's and c2's results, the sends, the trace lines and the
    metrics, after every block and pin returned."""
    async def main():
        async with cluster(config(mode="colocated", replicas=2, policy="round_robin")) as (backend, _):
            first, event = await collect(backend, "t1", LONG_HISTORY, PARAMS)
            assert isinstance(event, FinishEvent)
            await until(lambda: all(backend.router.kv_holders(k) for k in backend._block_hashes(LONG_HISTORY)))
            release = asyncio.Event()
            sent = _recording(backend, rewrite=rewrite, hold={m.FetchServe: release})
            shorter, longer = LONG_HISTORY[:96] + prompt(20, 14), LONG_HISTORY + prompt(20, 15)
            c1 = asyncio.create_task(collect(backend, "c1", shorter, PARAMS))
            try:
                await until(lambda: ("colocated-1#fetch", "FetchReserve") in sent)
                assert isinstance((await collect(backend, "f", prompt(20, 16), PARAMS))[1], FinishEvent)
                c2 = asyncio.create_task(collect(backend, "c2", longer, PARAMS))
                await _joined(backend, 1)  # c2 waits on c1's fetch, which cannot have landed yet
            finally:
                release.set()  # on a failure too, so c1's fetch ends and the cluster closes
            results = [await c1, await c2]
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            lines = {line["request_id"]: line for line in backend.trace.recent}
            return (shorter, longer), results, sent, lines, backend.metrics_text().decode()

    return asyncio.run(main())


def test_a_request_joins_a_running_fetch_of_a_shorter_prefix_and_fetches_only_the_rest():
    """c2 waits for c1's running fetch of 6 of its 8 blocks and fetches the 2 blocks after
    (before: its own fetch of all 8)."""
    prompts, results, sent, lines, _ = _shorter_then_longer()
    c1, c2 = lines["c1"], lines["c2"]
    assert (c1["prefill"], c1["fetch"], c1["fetch_remote_blocks"], c1["fetch_landed_blocks"]) == ("colocated-1", "fetch", 6, 6)
    assert (c2["prefill"], c2["fetch"], c2["fetch_local_blocks"], c2["fetch_remote_blocks"]) == ("colocated-1", "fetch", 0, 8)
    assert (c2["fetch_joined"], c2["fetch_joined_blocks"], c2["fetch_rest"]) == (True, 6, "fetch")
    assert c2["fetch_landed_blocks"] == 8 and c2["cached_tokens"] >= 128  # 6 joined + the 2 it fetched
    assert [kind for _, kind in sent].count("FetchReserve") == 2  # c1's, then c2's remainder
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    for p, (tokens, event) in zip(prompts, results):
        assert isinstance(event, FinishEvent)
        assert tokens == list(alone.generate([list(p)], PARAMS)[0].output_ids)


def _forged(msg):
    """The holder's FetchServe with one bit of its capability flipped: the destination refuses the
    landing, so the fetch fails the way a forged or stale plan does."""
    cap = bytearray(msg.plan.capability)
    cap[-1] ^= 1
    return m.FetchServe(msg.prompt_ids, msgspec.structs.replace(msg.plan, capability=bytes(cap)))


def test_a_request_that_joined_a_fetch_which_then_failed_recomputes_its_prefix():
    """As above, but c1's fetch fails (its plan's capability is refused at the destination): c2,
    waiting on it, lands nothing, recomputes the whole prefix instead of fetching the rest, and
    both requests still match the engine alone; every block and pin returns."""
    prompts, results, sent, lines, metrics = _shorter_then_longer({m.FetchServe: _forged})
    failed = _metric(metrics, 'pdserve_kv_fetches_total{result="failed"}')
    c1, c2 = lines["c1"], lines["c2"]
    assert (c1["fetch"], c1["fetch_landed_blocks"]) == ("fetch", 0) and c1["fetch_failure"]
    assert (c2["fetch_joined"], c2["fetch_joined_blocks"], c2["fetch_rest"]) == (True, 6, "recompute")
    assert c2["fetch_landed_blocks"] == 0  # (its prefill may still hit what c1's recompute cached)
    assert [kind for _, kind in sent].count("FetchReserve") == 1  # c2 started no fetch of its own
    assert failed == 1
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    for p, (tokens, event) in zip(prompts, results):
        assert isinstance(event, FinishEvent)
        assert tokens == list(alone.generate([list(p)], PARAMS)[0].output_ids)
