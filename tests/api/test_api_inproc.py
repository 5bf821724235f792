"""InProcessBackend on its own: event streams, aborts, failures, admission limits and shutdown."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api.backend import ErrorEvent, FinishEvent, GenerationRequest, Rejection, TokenEvent
from pdserve.api.inproc import InProcessBackend
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from tests.api.conftest import engine_config, engine_held_after, wait_idle

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def request(request_id: str, prompt=(257, 1, 2, 3), params=GREEDY) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(prompt), params)


async def drain(backend, req: GenerationRequest, limit: int | None = None) -> list:
    events = []
    async for event in backend.submit(req):
        events.append(event)
        if limit is not None and len(events) == limit:
            break
    return events


@pytest.fixture
def own_backend(tiny_model_dir):
    """A private backend, for tests that break or close it."""
    backend = InProcessBackend(Engine(engine_config(tiny_model_dir)), "own", max_pending=2)
    yield backend
    backend.close()


def test_events_match_engine(backend, reference_engine):
    events = asyncio.run(drain(backend, request("ip-1")))
    *token_events, last = events
    assert all(isinstance(e, TokenEvent) for e in token_events)
    ref = reference_engine.generate([[257, 1, 2, 3]], GREEDY)[0]
    assert sum((e.token_ids for e in token_events), ()) == ref.output_ids
    assert "".join(e.text for e in token_events) + last.text == ref.text
    assert last == FinishEvent("length", 4, 8)
    wait_idle(backend)


def test_invalid_request_is_an_error_event(backend):
    events = asyncio.run(drain(backend, request("ip-2", prompt=(257, 99_999))))
    assert len(events) == 1 and events[0].code == "invalid_request" and "out of range" in events[0].message
    assert isinstance(asyncio.run(drain(backend, request("ip-3")))[-1], FinishEvent)
    wait_idle(backend)


def test_duplicate_request_id_fails_only_the_duplicate(backend):
    async def both():
        return await asyncio.gather(drain(backend, request("ip-dup")), drain(backend, request("ip-dup")))

    first, second = asyncio.run(both())
    assert first[-1] == FinishEvent("length", 4, 8)
    assert second == [ErrorEvent("request id 'ip-dup' is already in use", "invalid_request")]
    wait_idle(backend)


def test_abort_mid_generation(backend):
    async def scenario(release):
        events = []
        async for event in backend.submit(request("ip-4", params=LONG)):
            events.append(event)
            if len(events) == 2:
                await backend.abort("ip-4")
                release()  # the abort is queued: it lands at the next step however fast the engine
        return events

    with engine_held_after(backend, 3) as release:
        events = asyncio.run(scenario(release))
    assert isinstance(events[-1], FinishEvent) and events[-1].finish_reason == "abort"
    assert events[-1].completion_tokens < 100
    wait_idle(backend)


def test_leaving_the_iteration_aborts(backend):
    events = asyncio.run(drain(backend, request("ip-5", params=LONG), limit=2))
    assert len(events) == 2
    wait_idle(backend)


def test_step_failure_fails_requests_and_keeps_serving(backend):
    def break_next_step(engine: Engine) -> None:
        def failing_step(*args, **kwargs):
            del engine.step  # back to the real method
            raise RuntimeError("injected step failure")

        engine.step = failing_step

    backend.run_on_engine(break_next_step).result(10)
    events = asyncio.run(drain(backend, request("ip-6")))
    assert events == [ErrorEvent("engine step failed: RuntimeError: injected step failure", "engine_error")]
    assert backend.healthy()
    assert asyncio.run(drain(backend, request("ip-7")))[-1] == FinishEvent("length", 4, 8)
    wait_idle(backend)


def test_broken_engine_turns_unhealthy_and_rejects(own_backend):
    def break_engine(engine: Engine) -> None:
        engine.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
        engine.check_integrity = lambda: (_ for _ in ()).throw(AssertionError("pool broken"))

    own_backend.run_on_engine(break_engine).result(10)
    assert asyncio.run(drain(own_backend, request("b-1")))[0].code == "engine_error"
    assert not own_backend.healthy() and own_backend.workers()[0].state == "broken"
    with pytest.raises(Rejection) as caught:
        asyncio.run(drain(own_backend, request("b-2")))
    assert caught.value.status == 503


def test_max_pending_rejects_with_429(own_backend):
    async def scenario():
        held = [aiter(own_backend.submit(request(f"p-{i}", params=LONG))) for i in range(2)]
        firsts = [await anext(it) for it in held]
        with pytest.raises(Rejection) as caught:
            await drain(own_backend, request("p-3"))
        for it in held:
            await it.aclose()
        return firsts, caught.value

    firsts, rejection = asyncio.run(scenario())
    assert all(isinstance(e, TokenEvent) for e in firsts)
    assert rejection.status == 429 and rejection.retry_after_s > 0
    assert 'pdserve_requests_total{result="rejected"} 1.0' in own_backend.metrics_text().decode()
    wait_idle(own_backend)


def test_close_fails_in_flight_and_rejects_new_work(own_backend):
    async def scenario(release):
        stream = aiter(own_backend.submit(request("c-1", params=LONG)))
        await anext(stream)
        closing = asyncio.get_running_loop().run_in_executor(None, own_backend.close)
        while own_backend.healthy():  # close() queues its stop as it turns unhealthy
            await asyncio.sleep(0.01)
        release()  # so the stop lands at the next step, before c-1 could finish on any machine
        await closing
        rest = [event async for event in stream]
        with pytest.raises(Rejection):
            await drain(own_backend, request("c-2"))
        return rest

    with engine_held_after(own_backend, 2) as release:
        rest = asyncio.run(scenario(release))
    assert rest[-1] == ErrorEvent("the backend was shut down", "shutdown")
    assert not own_backend.healthy() and own_backend.workers()[0].state == "stopped"
    own_backend.engine.assert_no_leaks()
