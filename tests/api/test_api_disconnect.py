"""A client that leaves mid-request gets its request aborted exactly once, and nothing leaks."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.api.conftest import MODEL, engine_held_after, wait_idle

LONG = {"model": MODEL, "prompt": "a long one", "max_tokens": 110, "ignore_eos": True}
# The real engine holds still after this many steps until the client has hung up and the abort is
# seen (engine_held_after): the request is live at the hang-up on a machine of any speed.
HELD_AFTER_STEPS = 3


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def read_events(url: str, body: dict, count: int) -> list[dict]:
    """Open an SSE stream, read `count` data events, then hang up."""
    events: list[dict] = []
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == count:
                    break
    return events


# ---- real engine --------------------------------------------------------------------------
def test_stream_disconnect_aborts_and_engine_returns_to_baseline(server, backend):
    with engine_held_after(backend, HELD_AFTER_STEPS):
        events = read_events(server.url + "/v1/completions", {**LONG, "stream": True}, count=2)
        request_id = events[0]["id"]
        wait_for(lambda: backend.abort_calls[request_id] >= 1)
    wait_idle(backend)
    time.sleep(0.2)
    assert backend.abort_calls[request_id] == 1


def test_chat_stream_disconnect_aborts(server, backend):
    # the template's tokens and 64 more fit the 128-token context (more is a 400, as vLLM)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "ignore_eos": True,
            "stream": True}
    with engine_held_after(backend, HELD_AFTER_STEPS):
        events = read_events(server.url + "/v1/chat/completions", body, count=2)
        request_id = events[0]["id"]
        assert request_id.startswith("chatcmpl-") and events[0]["choices"][0]["delta"]["role"] == "assistant"
        wait_for(lambda: backend.abort_calls[request_id] >= 1)
    wait_idle(backend)
    assert backend.abort_calls[request_id] == 1


def test_non_streaming_disconnect_aborts(server, backend):
    before = sum(backend.abort_calls.values())
    with engine_held_after(backend, 0):  # no token before the client gives up, however fast the engine
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.3)
        wait_for(lambda: sum(backend.abort_calls.values()) == before + 1)
    wait_idle(backend)


def test_finished_requests_are_not_aborted(server, backend):
    before = sum(backend.abort_calls.values())
    resp = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 3, "stream": True}, timeout=30)
    assert resp.text.endswith("data: [DONE]\n\n")
    resp = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 3}, timeout=30)
    assert resp.status_code == 200
    wait_idle(backend)
    assert sum(backend.abort_calls.values()) == before


# ---- scripted backend: every exit path ----------------------------------------------------
FAKE = {"model": "fake", "prompt": "hi"}


def test_fake_stream_disconnect_aborts_once(fake_server, fake):
    fake.endless = True
    events = read_events(fake_server.url + "/v1/completions", {**FAKE, "stream": True}, count=2)
    wait_for(lambda: fake.aborts)
    wait_for(lambda: fake.closed_iterators)
    time.sleep(0.2)
    assert fake.aborts == [events[0]["id"]] == fake.submitted


def test_fake_disconnect_while_waiting_for_first_token(fake_server, fake):
    fake.first_delay_s = 30.0
    for stream in (False, True):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(fake_server.url + "/v1/completions", json={**FAKE, "stream": stream}, timeout=0.3)
    wait_for(lambda: len(fake.aborts) == 2)
    time.sleep(0.2)
    assert fake.aborts == fake.submitted and len(set(fake.aborts)) == 2


def test_fake_non_streaming_disconnect_mid_generation(fake_server, fake):
    fake.endless = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/chat/completions",
                   json={"model": "fake", "messages": [{"role": "user", "content": "x"}]}, timeout=0.3)
    wait_for(lambda: fake.aborts)
    time.sleep(0.2)
    assert fake.aborts == fake.submitted


def test_fake_stream_ending_without_finish_is_an_error_and_aborted(fake_server, fake):
    fake.events = []  # the iterator simply stops
    resp = httpx.post(fake_server.url + "/v1/completions", json={**FAKE, "stream": True}, timeout=10)
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "incomplete_stream"
    wait_for(lambda: fake.aborts)
    assert fake.aborts == fake.submitted
