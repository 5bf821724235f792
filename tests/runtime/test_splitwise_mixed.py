"""`pdserve serve --mode splitwise --prefill 1 --decode 1 --mixed 1` (tiny model): the mixed worker
takes prompt work and hands its K/V off to the decode worker while the prompt pool is pressed,
receives K/V from the prefill worker and decodes while the token pool is pressed, and runs a
request whole when both phases choose it. The offer (which pools are pressed) is set by the test
in place of the pool controller's latch (unit-tested in tests/router/splitwise/test_mixed_pool.py), and
round robin makes each choice exact. Every request's greedy tokens equal a single engine's; the
pools end at baseline and the router's ledger is empty."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

import pytest

from pdserve.api.backend import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.router.splitwise.mixed_pool import MixedOffer
from pdserve.router.splitwise.splitwise import Thresholds
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
PROMPTS = [prompt(120 + 9 * i, 3100 + i) for i in range(6)]
CALM = Thresholds(prompt_high_s=1e6, prompt_low_s=1e5, kv_high=0.999, kv_low=0.998, hold=1000)  # never moves anyone
# round robin over the offered pools: (turn % |prefill pool|, turn % |decode pool|), own-role workers first
OFFERS = [MixedOffer(prefill=True)] * 2 + [MixedOffer(decode=True)] * 2 + [MixedOffer(True, True)] * 2
ROUTES = [("prefill-0", "decode-0"), ("mixed-0", "decode-0"),  # prompt pool pressed: m0 prefills, hands off
          ("prefill-0", "decode-0"), ("prefill-0", "mixed-0"),  # token pool pressed: m0 receives and decodes
          ("prefill-0", "decode-0"), ("mixed-0", "mixed-0")]  # both: m0 runs one whole


async def _scenario():
    cfg = config(mode="splitwise", num_prefill=1, num_decode=1, num_mixed=1, policy="round_robin", splitwise=CALM)
    async with cluster(cfg) as (backend, _):
        router = backend.router
        router.set_mixed_offer = lambda offer: None  # the test sets the offer, not the controller's latch
        results, lines = [], []
        for i, (offer, ids) in enumerate(zip(OFFERS, PROMPTS)):
            router.mixed_offer = offer
            results.append(await asyncio.wait_for(collect(backend, f"x{i}", ids, PARAMS), 120))
            lines.append(backend.trace.recent[-1])
        views = await wait_baseline(backend)
        router.assert_no_leaks()
        return results, lines, {w.id: (w.role, w.epoch) for w in views}, backend.metrics_text().decode()


def test_a_mixed_worker_prefills_for_a_handoff_decodes_a_handoff_and_runs_whole():
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    expected = [list(out.output_ids) for out in alone.generate([list(p) for p in PROMPTS], PARAMS)]  # batch-invariant
    results, lines, roles, metrics = asyncio.run(_scenario())
    assert all(isinstance(event, FinishEvent) for _, event in results)
    assert [ids for ids, _ in results] == expected
    assert [(line["prefill"], line["decode"]) for line in lines] == ROUTES
    assert [line["pd_reason"] for line in lines] == ["always"] * 5 + ["mixed_whole"]
    assert all(line["kv_published_s"] is not None for line in lines[:5]) and lines[5]["kv_published_s"] is None
    assert roles == {"prefill-0": ("prefill", 1), "decode-0": ("decode", 1), "mixed-0": ("mixed", 1)}
    assert 'pdserve_workers_live{role="mixed"} 1.0' in metrics
    assert "pdserve_role_changes_total{" not in metrics  # nobody moved: mixed workers serve both pools in place


# any K/V in use at the decode worker presses the token pool, for good; the prompt pool never is
TOKEN_MARKS = Thresholds(prompt_high_s=1e6, prompt_low_s=1e5, kv_high=1e-9, kv_low=0.0, hold=1, cooldown_s=3600.0)
# "hold" decodes until the test releases it (after "next" is served), so the controller's 0.5 s
# observations latch the offer and "next" is routed while "hold" still decodes on any machine;
# the cap (~30 s at 10 ms a token) is only reached if the release never comes
HOLDING = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.0)


async def _hold(backend, rid: str, ids: tuple[int, ...], release: asyncio.Event) -> list[int]:
    """Stream `rid` until `release` is set, then leave as a client does (the stream is closed and
    the router aborts the request); the tokens received by then."""
    tokens: list[int] = []
    stream = backend.submit(GenerationRequest(rid, ids, HOLDING))
    try:
        async for event in stream:
            assert not isinstance(event, (FinishEvent, ErrorEvent)), f"{rid} ended before its release: {event}"
            if isinstance(event, TokenEvent):
                tokens.extend(event.token_ids)
            if release.is_set():
                break
    finally:
        await stream.aclose()
    return tokens


async def _controller_scenario():
    cfg = config(mode="splitwise", num_prefill=1, num_decode=1, num_mixed=1, splitwise=TOKEN_MARKS)
    async with cluster(cfg) as (backend, _):
        release = asyncio.Event()
        holder = asyncio.create_task(_hold(backend, "hold", PROMPTS[0], release))  # calm offer: p0 -> d0
        deadline = asyncio.get_running_loop().time() + 60
        while not backend.router.mixed_offer.decode:  # the controller latched the token pool's pressure
            assert asyncio.get_running_loop().time() < deadline and not holder.done(), backend.router.mixed_offer
            await asyncio.sleep(0.05)
        offer = backend.router.mixed_offer
        second = await asyncio.wait_for(collect(backend, "next", PROMPTS[1], PARAMS), 120)
        release.set()
        first = await asyncio.wait_for(holder, 120)
        await wait_baseline(backend)  # the left hold's blocks and holds came back too
        backend.router.assert_no_leaks()
        return offer, first, second, {line["request_id"]: line for line in backend.trace.recent}


def test_the_pool_controller_offers_the_mixed_worker_to_a_pressed_token_pool():
    offer, first, second, lines = asyncio.run(_controller_scenario())
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    # greedy: the held request's tokens up to its release are the prefix of a single engine's run
    want_first, want_second = (list(out.output_ids) for out in alone.generate(
        [list(PROMPTS[0]), list(PROMPTS[1])], [replace(HOLDING, max_tokens=len(first)), PARAMS]))
    assert offer == MixedOffer(prefill=False, decode=True)
    assert first and first == want_first and second[0] == want_second
    assert (lines["hold"]["prefill"], lines["hold"]["decode"]) == ("prefill-0", "decode-0")
    # jsq over the decode pool [decode-0 (decoding "hold"), mixed-0 (idle)]: the mixed worker decodes
    assert (lines["next"]["prefill"], lines["next"]["decode"]) == ("prefill-0", "mixed-0")


def _serve_args(*argv: str) -> argparse.Namespace:
    from pdserve.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_flags_make_a_mixed_pool_with_prompt_priority_on():
    from pdserve.commands.serve import serve_config

    cfg = serve_config(_serve_args("--mode", "splitwise", "--prefill", "1", "--decode", "1", "--mixed", "2"))
    assert [r.value for r in cfg.shape().roles()] == ["prefill", "decode", "mixed", "mixed"]
    assert cfg.engine.prompt_priority is not None  # --prompt-priority auto: on in splitwise mode, mixed workers too


@pytest.mark.parametrize("argv, message", [
    (("--mixed", "1"), "--mixed 1 goes with --mode splitwise"),
    (("--mode", "splitwise", "--prefill", "1", "--decode", "1", "--mixed", "-1"), "worker counts must be >= 0"),
    (("--mode", "splitwise", "--prefill", "0", "--decode", "0", "--mixed", "0"), "no workers"),
    (("--mode", "splitwise", "--workers", "4", "--mixed", "1"), "explicit --prefill P --decode D --mixed M"),
])
def test_bad_mixed_pool_flags_are_refused_with_a_message(argv, message, capsys):
    from pdserve.commands.serve import run

    assert run(_serve_args(*argv)) == 2
    assert message in capsys.readouterr().err


async def _until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


async def _mixed_first_scenario():
    cfg = config(mode="splitwise", num_prefill=2, num_decode=1, num_mixed=1, splitwise=TOKEN_MARKS)
    async with cluster(cfg) as (backend, _):
        router, release = backend.router, asyncio.Event()
        lent = lambda: [w for w in ("prefill-0", "prefill-1") if router.lent_to(w) is not None]
        first = asyncio.create_task(_hold(backend, "hold", PROMPTS[0], release))  # calm offer: decode-0 decodes it
        await _until(lambda: router.mixed_offer.decode or first.done(), "the token pool's pressure never latched")
        await asyncio.sleep(1.5)  # three more observations: the idle mixed worker has room, nobody is lent
        lent_while_room = lent()
        second = asyncio.create_task(_hold(backend, "hold2", PROMPTS[1], release))  # decodes on the mixed worker
        await _until(lambda: lent() or second.done(), "no prefill worker was lent once the mixed worker was busy")
        lent_when_full = lent()
        release.set()
        tokens = [await asyncio.wait_for(first, 120), await asyncio.wait_for(second, 120)]
        await wait_baseline(backend)
        router.assert_no_leaks()
        return lent_while_room, lent_when_full, tokens, {line["request_id"]: line for line in backend.trace.recent}


def test_a_pressed_token_pool_takes_the_mixed_worker_before_it_borrows_a_prefill_worker(monkeypatch):
    from pdserve.router.splitwise import splitwise

    seen, least_loaded = [], splitwise._least_loaded
    monkeypatch.setattr(splitwise, "_least_loaded", lambda load, lent: seen.append(dict(load)) or least_loaded(load, lent))
    lent_while_room, lent_when_full, tokens, lines = asyncio.run(_mixed_first_scenario())
    assert lent_while_room == []  # before: prefill-0 was lent at the observation that latched the offer
    assert (lines["hold"]["decode"], lines["hold2"]["decode"]) == ("decode-0", "mixed-0")
    # the least loaded prefill worker by the queues the controller read, once mixed-0's K/V is in use
    # (prefill-0 when both are idle; prefill-1 where prefill-0's report of hold2's prefill was not yet in)
    assert set(seen[0]) == {"prefill-0", "prefill-1"}
    assert lent_when_full == [min(seen[0], key=lambda w: (seen[0][w], w))]
    alone = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    want = [list(out.output_ids) for out in alone.generate(
        [list(PROMPTS[0]), list(PROMPTS[1])], [replace(HOLDING, max_tokens=len(t)) for t in tokens])]
    assert all(tokens) and tokens == want
