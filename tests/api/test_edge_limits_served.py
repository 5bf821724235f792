"""Slow and silent HTTP clients against a real `pdserve serve` process (api/edge/connections.py): a body
or a head that does not arrive in time answers 408 and its connection is closed; a client past
--max-connections answers 503 at once; meanwhile and afterwards completions, streams, kept-alive
connections, the API key check and the 4 MiB body limit behave as before. Before the limits a
trickling client held its connection, and so a file descriptor, forever."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api.served_cli import served_cli

KEY = "k-edge"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 1.0, 1.5, 8
SLACK_S = 10.0  # a loaded or slow machine may run a timer late, never early: this bounds only "never"


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    keys = tmp_path_factory.mktemp("edge") / "keys"
    keys.write_text(f"{KEY} tenant-a\n")
    with served_cli("--api-keys", str(keys), "--request-header-timeout-s", str(HEADER_TIMEOUT_S),
                    "--request-body-timeout-s", str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)) as (_, p, _):
        yield p


def completion(max_tokens: int = 4, stream: bool = False) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": stream, "return_token_ids": stream}).encode()


def head(body_len: int, key: str = KEY) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (key.encode(), body_len))


def connect(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock


def until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s from now)."""
    start, got = time.monotonic(), b""
    sock.settimeout(timeout_s)
    with sock:
        while chunk := sock.recv(65536):
            got += chunk
    return got, time.monotonic() - start


def error_of(answer: bytes) -> tuple[int, dict]:
    """(status, OpenAI error object) of a whole answer with `Connection: close`."""
    top, _, body = answer.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    assert "connection: close" in [h.lower() for h in lines[1:]], lines
    return int(lines[0].split()[1]), json.loads(body)["error"]


def completes(port: int) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=completion(), headers=auth, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text


def test_a_trickled_body_answers_408_at_its_deadline_and_is_closed_while_others_are_served(port):
    body = completion()
    slow = [connect(port, head(len(body)) + body[:7]) for _ in range(3)]  # headers and part of the body, then nothing
    silent = connect(port, head(len(body)))  # headers, then not a byte of the body
    start = time.monotonic()
    completes(port)  # served while the slow ones are held
    with stream(port, 200) as events:  # open across the slow ones' deadline: the body deadline ends with the body
        first = next(events)
        assert first.startswith("data: ")
        for sock in [*slow, silent]:
            answer, _ = until_closed(sock, BODY_TIMEOUT_S + SLACK_S)
            status, error = error_of(answer)
            assert status == 408 and error["code"] == "request_timeout" and "--request-body-timeout-s" in error["message"]
        assert BODY_TIMEOUT_S - 0.05 <= time.monotonic() - start <= BODY_TIMEOUT_S + SLACK_S
        rest = list(events)  # the other 199 tokens, the finish, [DONE]: whole, past the deadline
        assert rest[-1] == "data: [DONE]" and time.monotonic() - start > BODY_TIMEOUT_S
        # counted in tokens, not events: a reader that lags gets its tokens merged
        # (router/process/output_collector.py), as this one may while it waits on the slow sockets
        chunks = [json.loads(line[len("data: "):]) for line in [first, *rest[:-1]]]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 200
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    completes(port)


@contextlib.contextmanager
def stream(port: int, max_tokens: int) -> Iterator[Iterator[str]]:
    """The `data:` lines of a streamed completion, read as the caller goes."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", content=completion(max_tokens, stream=True),
                      headers=auth, timeout=60) as answer:
        assert answer.status_code == 200
        yield (line for line in answer.iter_lines() if line.startswith("data: "))


def test_a_head_that_never_completes_answers_408_at_its_deadline_and_is_closed(port):
    partial, silent = connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: pd"), connect(port)
    start = time.monotonic()
    for sock in (partial, silent):
        answer, _ = until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)
        status, error = error_of(answer)
        assert status == 408 and "--request-header-timeout-s" in error["message"]
    assert HEADER_TIMEOUT_S - 0.05 <= time.monotonic() - start <= HEADER_TIMEOUT_S + SLACK_S
    completes(port)


def test_a_kept_alive_connection_idles_past_the_head_deadline_but_a_partial_next_head_is_closed(port):
    """uvicorn keeps an idle connection 5 s (timeout_keep_alive): longer than the head deadline, and
    the deadline starts only at the next head's first byte, which used to end uvicorn's timer."""
    body = completion()
    sock = connect(port, head(len(body)) + body)
    time.sleep(HEADER_TIMEOUT_S + 0.5)
    sock.sendall(head(len(body)) + body)  # the same connection serves a second request
    time.sleep(HEADER_TIMEOUT_S + 0.5)
    sock.sendall(b"GET /hea")  # a third head, never finished
    answer, _ = until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    status, error = error_of(answer[answer.rindex(b"HTTP/1.1 "):])
    assert status == 408 and error["code"] == "request_timeout"


def test_past_max_connections_a_new_client_is_answered_503_at_once(port):
    time.sleep(0.3)  # the earlier tests' connections are gone
    body = completion()
    held = [connect(port, head(len(body)) + body[:3]) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.3)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    refused = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=body, headers=auth, timeout=10)
    assert refused.status_code == 503, refused.text  # at once: a head or body deadline would have been a 408
    assert refused.json()["error"]["code"] == "too_many_connections" and refused.headers["retry-after"] == "1"
    for sock in held:  # their bodies' deadline frees their slots
        status, _ = error_of(until_closed(sock, BODY_TIMEOUT_S + SLACK_S)[0])
        assert status == 408
    time.sleep(0.3)
    completes(port)


def test_the_key_check_and_the_body_limit_still_answer_first(port):
    body = completion()
    unkeyed = until_closed(connect(port, head(len(body), key="wrong") + body[:5]), BODY_TIMEOUT_S + SLACK_S)[0]
    assert b"HTTP/1.1 401 " in unkeyed and b"invalid_api_key" in unkeyed  # then closed at the body deadline
    oversized = connect(port, head((4 << 20) + 1))  # the default --max-request-body-bytes, declared: 413 at once
    status, error = error_of(until_closed(oversized, 5.0)[0])
    assert status == 413 and error["code"] == "request_too_large"
    completes(port)


def requests_by_result(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith('pdserve_requests_total{result="')}


def test_a_client_that_closes_after_its_request_aborts_it_before_any_answer(port):
    """The client's FIN is its disconnect, as nginx's proxy takes it: a non-streamed request whose
    client closed is aborted at once (its K/V freed), not generated to the end for nobody. (An
    edge that kept the connection open for a half-closing client's answer lost this: a FIN does not
    say whether the client still reads.)"""
    before = requests_by_result(port)
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 1000, "ignore_eos": True}).encode()
    connect(port, head(len(body)) + body).close()  # the request and the FIN together
    deadline = time.monotonic() + 60
    while (after := requests_by_result(port)).get("aborted", 0) == before.get("aborted", 0):
        assert time.monotonic() < deadline, "the closed client's request was never aborted"
        time.sleep(0.05)
    assert after.get("length", 0) == before.get("length", 0)  # ended by the abort, not by max_tokens
    completes(port)
