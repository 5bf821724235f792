"""`pdserve bench --closed-loop` (bench/closed_loop.py) against a fake transport: each turn is sent
after the previous one ended and its prompt is the previous prompt + the streamed answer + new
user text; a failed turn ends its conversation; TTFT is summarised per turn and over turns >= 1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from pdserve.bench import closed_loop
from pdserve.bench.http.client import EndpointConfig
from pdserve.bench.closed_loop import ClosedLoopConfig, run_closed_loop, summarize_turns


class Response:
    def __init__(self, status: int, lines):
        self.status, self.lines = status, lines


class FakeTransport:
    """Answers every completion with "A<n>" for the n-th request; the request `fail_at` gets a 503."""

    def __init__(self, fail_at: int | None = None):
        self.bodies: list[dict] = []
        self.fail_at = fail_at

    @contextlib.asynccontextmanager
    async def post_lines(self, path, body, headers):
        self.bodies.append(body)
        n = len(self.bodies)

        async def lines():
            chunks = [{"choices": [{"text": f"A{n}", "finish_reason": None}]}, {"usage": {"completion_tokens": 1}}]
            for chunk in chunks:
                yield time.perf_counter(), "data: " + json.dumps(chunk)
            yield time.perf_counter(), "data: [DONE]"

        yield Response(503 if n == self.fail_at else 200, lines())

    async def aclose(self):
        pass


ENDPOINT = EndpointConfig("http://x", "m")


def run(config, transport, monkeypatch):
    monkeypatch.setattr(closed_loop, "make_transport_for", lambda endpoint: transport)
    return asyncio.run(run_closed_loop(ENDPOINT, config))


def test_each_turn_carries_the_previous_answer(monkeypatch):
    transport = FakeTransport()
    turns = run(ClosedLoopConfig(1, 3, input_len=20, turn_len=5, output_len=4, shared_prefix_len=8), transport, monkeypatch)
    prompts = [b["prompt"] for b in transport.bodies]
    assert [t.turn for t in turns] == [0, 1, 2] and all(t.record.success for t in turns)
    assert len(prompts[0]) == 28
    assert prompts[1].startswith(prompts[0] + "A1") and len(prompts[1]) == 28 + 2 + 5
    assert prompts[2].startswith(prompts[1] + "A2") and len(prompts[2]) == 35 + 2 + 5
    summary = summarize_turns(turns)
    assert summary["later_turns"]["n"] == 2 and set(summary["turns"]) == {0, 1, 2} and summary["failed"] == 0


def test_conversations_share_the_system_prefix_and_a_failed_turn_ends_its_conversation(monkeypatch):
    transport = FakeTransport(fail_at=2)
    turns = run(ClosedLoopConfig(2, 3, input_len=10, turn_len=3, output_len=2, shared_prefix_len=6), transport, monkeypatch)
    firsts = [b["prompt"] for b in transport.bodies if len(b["prompt"]) == 16]  # the two turn-0 prompts
    assert len(firsts) == 2 and firsts[0][:6] == firsts[1][:6] and firsts[0] != firsts[1]
    failed = [t for t in turns if not t.record.success]
    assert len(failed) == 1 and failed[0].record.error == "http:503"
    stopped = [t.turn for t in turns if t.conversation == failed[0].conversation]
    other = [t.turn for t in turns if t.conversation != failed[0].conversation]
    assert stopped == list(range(failed[0].turn + 1)) and other == [0, 1, 2]  # no turn after the failure
    assert summarize_turns(turns)["failed"] == 1


def test_config_refuses_empty_runs():
    with pytest.raises(ValueError):
        ClosedLoopConfig(0, 3, 10, 3, 2)
