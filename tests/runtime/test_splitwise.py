"""`pdserve serve --mode splitwise` (tiny model): the spec's loan. A lasting prompt backlog makes
the pool controller lend a token worker to the prompt pool (1 prompt + 2 token workers at start):
it keeps its role and epoch and serves both pools, its running decodes go on (nothing drains);
the loan ends by the worker taking its own phase's work only, again without a drain, and only an
adoption is a role change (the one mechanism: drain, new epoch, register again). Every request,
before, during and after each move, gets the tokens a single engine produces, and nothing leaks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.prompt_priority import PromptPriority
from pdserve.engine.sequence import SamplingParams
from pdserve.router.messages import Role
from pdserve.router.process.role_control import apply_move
from pdserve.router.splitwise.splitwise import Move, Thresholds
from tests.runtime.conftest import (
    TINY,
    WORKER_THREADS,
    collect,
    config,
    prompt,
    wait_baseline,
)

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
PROMPTS = [prompt(300 + 11 * i, 900 + i) for i in range(10)]
# any queued prompt work counts as pressed; one observation is "lasting"; one move per run
MARKS = Thresholds(prompt_high_s=1e-6, prompt_low_s=0.0, kv_high=0.99, kv_low=0.9, hold=1, cooldown_s=3600.0)


async def _scenario():
    cfg = config(mode="splitwise", num_prefill=1, num_decode=2, splitwise=MARKS)
    async with cluster(cfg) as (backend, _):
        results = await asyncio.wait_for(asyncio.gather(
            *(collect(backend, f"s{i}", p, PARAMS) for i, p in enumerate(PROMPTS))), 180)
        deadline = time.monotonic() + 60
        while not any(backend.router.lent_to(w) is Role.PREFILL for w in ("decode-0", "decode-1")):
            assert time.monotonic() < deadline, [(w.id, w.role, w.state) for w in backend.workers()]
            await asyncio.sleep(0.1)
        after = await collect(backend, "after", PROMPTS[0], PARAMS)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        lent = [w for w in ("decode-0", "decode-1") if backend.router.lent_to(w) is Role.PREFILL]
        return results, after, lent, {w.id: (w.role, w.epoch) for w in backend.workers()}, backend.metrics_text().decode()


def test_a_prompt_backlog_lends_a_token_worker_to_the_prompt_pool():
    engine = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    expected = [list(out.output_ids) for out in engine.generate([list(p) for p in PROMPTS], PARAMS)]  # batch-invariant
    results, after, lent, roles, metrics = asyncio.run(_scenario())
    assert all(isinstance(event, FinishEvent) for _, event in results)
    assert [ids for ids, _ in results] == expected and after[0] == expected[0]
    assert len(lent) == 1  # the mixed state: its role and epoch unchanged, no role change
    assert roles == {"prefill-0": ("prefill", 1), "decode-0": ("decode", 1), "decode-1": ("decode", 1)}
    assert 'pdserve_pool_moves_total{kind="lend"} 1.0' in metrics
    assert "pdserve_role_changes_total{" not in metrics


# ---- a mixed worker's prompt priority (engine/prompt_priority.py) ------------------------------
LONG = SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.0)
# the two that take the batch's slots decode long enough that a fast machine's heartbeats (0.25 s)
# still see both decoding before they finish
HELD = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
MIXED = [prompt(40 + 7 * i, 1200 + i) for i in range(3)]


async def _mixed_scenario(engine: EngineConfig):
    # every request prefills where it decodes (a worker running both phases); nothing moves pools
    cfg = config(mode="splitwise", num_prefill=1, num_decode=1, pd_decision="never", engine=engine)
    async with cluster(cfg) as (backend, _):
        first = [asyncio.create_task(collect(backend, f"m{i}", MIXED[i], HELD)) for i in range(2)]
        deadline = time.monotonic() + 60
        while not any(w.load and w.load["active_decode"] == 2 for w in backend.workers()):
            assert time.monotonic() < deadline and not any(t.done() for t in first), "both never decoded at once"
            await asyncio.sleep(0.02)
        third = await collect(backend, "m2", MIXED[2], LONG)
        results = [*await asyncio.gather(*first), third]
        views = await wait_baseline(backend)
        backend.router.assert_no_leaks()
        return results, {w.id: w.load for w in views}, backend.metrics_text().decode()


def test_a_mixed_worker_gives_a_waiting_prompt_a_young_decodes_slot():
    engine = replace(TINY, max_num_seqs=2, prompt_priority=PromptPriority(age_override_ms=1e9, max_preemptions=1))
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    params = [HELD, HELD, LONG]
    expected = [list(out.output_ids) for out in alone.generate([list(p) for p in MIXED], params)]  # batch-invariant
    results, loads, metrics = asyncio.run(_mixed_scenario(engine))
    assert all(isinstance(event, FinishEvent) and len(ids) == q.max_tokens for (ids, event), q in zip(results, params))
    # the two that kept their slots are exact; the displaced one recomputed its K/V by prefill,
    # which may flip a bf16 near-tie after the point it was displaced (engine/prompt_priority.py)
    exact = [ids == want for (ids, _), want in zip(results, expected)]
    assert sum(exact) >= 2 and all(ids[0] == want[0] for (ids, _), want in zip(results, expected))
    assert loads["decode-0"]["num_priority_preemptions"] == 1 == loads["decode-0"]["num_preemptions"]
    assert 'pdserve_engine_preemptions{cause="prompt_priority",worker="decode-0"} 1.0' in metrics


# ---- two machines: the last prompt worker is lent to the token pool (it keeps prefilling) -----
# any decode work presses the token pool; the prompt pool is never pressed; one move per run
TOKEN_MARKS = Thresholds(prompt_high_s=1e6, prompt_low_s=1e5, kv_high=1e-9, kv_low=0.0, hold=1, cooldown_s=3600.0)


async def _two_machine_scenario():
    cfg = config(mode="splitwise", num_prefill=1, num_decode=1, pd_decision="never", splitwise=TOKEN_MARKS)
    async with cluster(cfg) as (backend, _):
        first = await asyncio.wait_for(asyncio.gather(
            *(collect(backend, f"t{i}", p, LONG) for i, p in enumerate(MIXED))), 180)
        moved = asyncio.Event()

        async def press() -> list:  # decode work until the move: the controller samples every 0.5 s,
            runs = []                              # and a fast machine can finish the first batch between samples
            while not moved.is_set():
                runs.append(await collect(backend, f"p{len(runs)}", MIXED[0], LONG))
            return runs

        pressing = asyncio.create_task(press())
        deadline = time.monotonic() + 60
        while backend.router.lent_to("prefill-0") is not Role.DECODE:
            assert time.monotonic() < deadline, [(w.id, w.role, w.state) for w in backend.workers()]
            await asyncio.sleep(0.1)
        moved.set()
        pressed = await asyncio.wait_for(pressing, 180)
        after = await asyncio.wait_for(asyncio.gather(
            *(collect(backend, f"a{i}", p, LONG) for i, p in enumerate(MIXED))), 180)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        lines = [line for line in backend.trace.recent if line["request_id"][0] in "pa"]
        return (first, pressed), after, lines, {w.id: (w.role, w.epoch) for w in backend.workers()}, backend.metrics_text().decode()


def test_the_last_prompt_worker_is_lent_to_the_token_pool_and_runs_requests_whole():
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    expected = [list(out.output_ids) for out in alone.generate([list(p) for p in MIXED], LONG)]  # batch-invariant
    (first, pressed), after, lines, roles, metrics = asyncio.run(_two_machine_scenario())
    assert [ids for ids, _ in first] == expected and [ids for ids, _ in after] == expected
    assert all(ids == expected[0] for ids, _ in pressed)  # the requests running across the move, whole too
    # lent, not changed: prefill-0 keeps its role and epoch and decodes as well; with pd "never"
    # every request runs whole, on decode-0 or (both phases choosing it) on prefill-0
    assert roles == {"prefill-0": ("prefill", 1), "decode-0": ("decode", 1)}
    assert all(line["prefill"] == line["decode"] for line in lines)
    assert any(line["decode"] == "prefill-0" for line in lines if line["request_id"].startswith("a"))
    assert 'pdserve_pool_moves_total{kind="lend"} 1.0' in metrics and "pdserve_role_changes_total{" not in metrics


# ---- the loan's life, each move carried out as the controller's loop does (apply_move) ---------
# round robin over the pools, own workers first and the lent one last: turn t routes
# (t mod |prompt pool|, t mod |token pool|), so every route below is exact
NEVER = Thresholds(prompt_high_s=1e6, prompt_low_s=1e5, kv_high=0.999, kv_low=0.998, hold=1000)  # the test moves
SHORT = [prompt(60 + 13 * i, 4100 + i) for i in range(5)]
LOAN_ROUTES = {"b2": ("prefill-0", "decode-0"),  # lent: decode-0 still takes token work (its own pool)
               "b3": ("decode-0", "decode-1"),  # and prompt work, handed off to decode-1 (the pool it serves)
               "c4": ("prefill-0", "decode-0"), "c5": ("prefill-0", "decode-1"),  # returned: token work only
               "d6": ("decode-0", "decode-1")}  # adopted: decode-0 is a prefill worker (epoch 2), first by id


async def _routed(backend, rid: str) -> None:
    deadline = time.monotonic() + 60
    while rid not in backend.live or not backend.live[rid].decode_id:
        assert time.monotonic() < deadline, f"{rid} never routed"
        await asyncio.sleep(0.005)


async def _loan_scenario():
    cfg = config(mode="splitwise", num_prefill=1, num_decode=2, policy="round_robin", splitwise=NEVER)
    async with cluster(cfg) as (backend, _):
        held = [asyncio.create_task(collect(backend, "h0", MIXED[0], HELD))]  # turn 0: (prefill-0, decode-0)
        await _routed(backend, "h0")
        held.append(asyncio.create_task(collect(backend, "h1", MIXED[1], HELD)))  # turn 1: (prefill-0, decode-1)
        deadline = time.monotonic() + 60
        while not any(w.id == "decode-0" and w.load and w.load["active_decode"] for w in backend.workers()):
            assert time.monotonic() < deadline and not held[0].done(), "h0 never decoded at decode-0"
            await asyncio.sleep(0.02)
        assert apply_move(backend, Move("decode-0", "prefill", "test")) is None  # at once: nothing drains
        running_at_lend = "h0" in backend.live
        shown = next(w.load.get("lent_to") for w in backend.workers() if w.id == "decode-0")  # /workers
        lent = [asyncio.create_task(collect(backend, rid, SHORT[i], PARAMS)) for i, rid in enumerate(("b2", "b3"))]
        await _routed(backend, "b3")
        running_while_lent = "h0" in backend.live  # decode-0 took prompt work while it decoded h0
        assert apply_move(backend, Move("decode-0", "decode", "test", "return")) is None  # b3 runs on
        returned = [await collect(backend, rid, SHORT[2 + i], PARAMS) for i, rid in enumerate(("c4", "c5"))]
        loaned = await asyncio.wait_for(asyncio.gather(*held, *lent), 180)
        apply_move(backend, Move("decode-0", "prefill", "test"))
        await asyncio.wait_for(apply_move(backend, Move("decode-0", "prefill", "test", "change")), 60)
        adopted = await collect(backend, "d6", SHORT[4], PARAMS)
        views = await wait_baseline(backend)
        backend.router.assert_no_leaks()
        lines = {line["request_id"]: line for line in backend.trace.recent}
        return ((running_at_lend, running_while_lent, shown), [*loaned, *returned, adopted], lines,
                {w.id: (w.role, w.epoch) for w in views}, backend.metrics_text().decode())


def test_a_lent_worker_keeps_its_decodes_serves_both_phases_and_returns_without_a_drain():
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    held = [list(out.output_ids) for out in alone.generate([list(p) for p in MIXED[:2]], HELD)]  # batch-invariant
    short = [list(out.output_ids) for out in alone.generate([list(p) for p in SHORT], PARAMS)]
    running, results, lines, roles, metrics = asyncio.run(_loan_scenario())
    assert running == (True, True, "prefill")  # h0 decoded at decode-0 all through the lend and the borrowed prefill
    assert all(isinstance(event, FinishEvent) for _, event in results)
    assert [ids for ids, _ in results] == [*held, *short]
    assert (lines["h0"]["decode"], lines["h0"]["reroutes"], lines["h0"]["retries"]) == ("decode-0", 0, 0)
    assert {rid: (lines[rid]["prefill"], lines[rid]["decode"]) for rid in LOAN_ROUTES} == LOAN_ROUTES
    assert all(lines[rid]["reroutes"] == 0 and lines[rid]["kv_published_s"] is not None for rid in ("b3", "c4"))
    assert roles == {"prefill-0": ("prefill", 1), "decode-0": ("prefill", 2), "decode-1": ("decode", 1)}
    assert 'pdserve_pool_moves_total{kind="lend"} 2.0' in metrics and 'pdserve_pool_moves_total{kind="return"} 1.0' in metrics
    # only the adoption changed a role: one ChangeRole, decode-0 drained once under its epoch 1
    assert 'pdserve_role_changes_total{from_role="decode",to_role="prefill"} 1.0' in metrics
    assert 'pdserve_pool_moves_total{kind="change"} 1.0' in metrics
