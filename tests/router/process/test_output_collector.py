"""A request's events on their way to its client: merged per choice while the client lags, against
a plain per-event fold; terminal events exact and last."""

from __future__ import annotations

import asyncio
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.outputs import TokenLogprobs
from pdserve.router.contract import ErrorEvent, FinishEvent, TokenEvent
from pdserve.router.process import output_collector
from pdserve.router.process.output_collector import MAX_SEPARATE, OutputCollector


def _token(index: int, tid: int, finish: str | None = None, prompt: tuple | None = None) -> TokenEvent:
    return TokenEvent((tid,), f"<{tid}>", index, finish, (TokenLogprobs(tid, -0.5 - tid / 7, (tid, 7), (-0.5 - tid / 7, -9.25)),),
                      prompt)


def _fold(events: list) -> dict[int, tuple]:
    """Per choice: (ids, text, logprobs, finish_reason, prompt logprobs) of the events, one by one."""
    out: dict[int, tuple] = {}
    for e in events:
        ids, text, lps, finish, prompt = out.get(e.index, ((), "", (), None, None))
        out[e.index] = (ids + e.token_ids, text + e.text, lps + e.logprobs, e.finish_reason or finish, prompt or e.prompt_logprobs)
    return out


async def _drain(collector: OutputCollector) -> list:
    taken: list = []
    while not taken or isinstance(taken[-1], TokenEvent):
        taken.append(await collector.get())
    return taken


async def _take_now(collector: OutputCollector) -> list:
    """What a client takes between two puts: the next event if one is ready, else nothing."""
    task = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)  # one step of `get`: enough to return whatever is ready
    if task.done():
        return [task.result()]
    task.cancel()
    return []


def test_a_client_that_keeps_up_gets_every_event_as_put():
    put = [_token(0, 5, prompt=(1,)), _token(1, 6), _token(0, 7, "stop"), FinishEvent("length", 3, 3)]

    async def run() -> list:
        collector = OutputCollector()
        taken = []
        for event in put:
            collector.put(event)
            taken += await _take_now(collector)
        return taken
    taken = asyncio.run(run())
    assert all(a is b for a, b in zip(taken, put, strict=True))  # the same objects: nothing copied
    assert taken == [_token(0, 5, prompt=(1,)), _token(1, 6), _token(0, 7, "stop"), FinishEvent("length", 3, 3)]


def test_a_lagging_client_gets_separate_events_then_one_merged_delta_per_choice_then_the_finish():
    events = []
    for k in range(MAX_SEPARATE + 5):  # choice 1 speaks first; sequence 0's first token has the prompt logprobs
        events += [_token(1, 100 + k, "length" if k == MAX_SEPARATE + 4 else None), _token(0, 200 + k, prompt=(9,) if k == 0 else None)]
    collector = OutputCollector()
    for event in events:
        collector.put(event)
    collector.put(FinishEvent("stop", 4, len(events), cached_tokens=2))
    taken = asyncio.run(_drain(collector))
    assert taken[-1] == FinishEvent("stop", 4, len(events), cached_tokens=2)
    assert [e.index for e in taken[:-1]] == [1, 0] * MAX_SEPARATE
    assert all(a is b for a, b in zip(taken[: 2 * MAX_SEPARATE - 2], events))  # as they came, up to the margin
    assert [len(e.token_ids) for e in taken[-3:-1]] == [6, 6]  # each choice's newest took its last 5 tokens
    assert _fold(taken[:-1]) == _fold(events)
    assert taken[-3].finish_reason == "length" and taken[1].prompt_logprobs == (9,)


def test_the_first_terminal_ends_the_stream_and_waits_behind_pending_tokens():
    collector = OutputCollector()
    collector.put(_token(0, 1))
    collector.put(ErrorEvent("lost", "worker_lost"))
    collector.put(_token(0, 2))
    collector.put(FinishEvent("stop", 1, 2))
    assert asyncio.run(_drain(collector)) == [_token(0, 1), ErrorEvent("lost", "worker_lost")]


_LOGPROB = st.floats(max_value=0.0, allow_nan=False)  # -inf included: a masked token's
_EVENTS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50_000), st.booleans(),
                             st.lists(st.tuples(st.integers(0, 50_000), _LOGPROB), max_size=3), _LOGPROB), max_size=60)


@settings(max_examples=200, deadline=None)
@given(events=_EVENTS, takes=st.lists(st.booleans(), max_size=60), margin=st.integers(1, 3))
def test_any_interleaving_of_puts_and_takes_delivers_the_same_content_as_the_plain_fold(events, takes, margin):
    async def run() -> tuple[list, list]:
        collector = OutputCollector()
        put, taken = [], []
        for (index, tid, with_text, top, value), take in zip(events, takes + [False] * len(events)):
            ids = (tid,) if with_text or tid % 2 else ()
            logprobs = tuple(TokenLogprobs(t, value, tuple(i for i, _ in top), tuple(v for _, v in top)) for t in ids)
            event = TokenEvent(ids, f"t{tid}" if with_text else "", index, None, logprobs)
            put.append(event)
            collector.put(event)
            if take:
                taken += await _take_now(collector)
        collector.put(FinishEvent("length", 2, len(put)))
        return put, taken + await _drain(collector)
    with mock.patch.object(output_collector, "MAX_SEPARATE", margin):  # small: most runs merge
        put, taken = asyncio.run(run())
    assert taken[-1] == FinishEvent("length", 2, len(put))
    assert all(isinstance(e, TokenEvent) for e in taken[:-1])
    assert _fold(taken[:-1]) == _fold(put)
    assert len(taken) - 1 <= len(put)
