"""A stop signal to the `pdserve serve` process alone (a user's `kill PID`, Ctrl-C in a terminal
that reaches only the server) while streams are open (api/edge/stop.py, ClusterBackend.stop_serving).

Found by an adversarial pass: uvicorn stops by waiting for every open response to end, and the
workers, which got no signal, went on generating, so a SIGTERM took as long as the longest open
generation (35 s for 12 streams of 1,500 tokens; a client that stopped reading held it until
--response-write-timeout-s); a second SIGTERM meanwhile was ignored (uvicorn forces only on a
second SIGINT, and ended the process with status 0). Now each started request ends at the signal
with an error event (`shutdown`), a response still open STOP_GRACE_S later has its connection cut,
a second signal kills the workers and ends the process at once (a storm of them once), and the
exit status is the signal's."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.api.edge.stop import STOP_GRACE_S
from tests.api.served_cli import serve_logged, stop, wait_healthy
from tests.runtime.test_stop_served import group_members

MAX_TOKENS = 3000  # far longer than a stop takes, on any machine: the streams are open at the signal


def _stream(port: int, out: list[str]) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as answer:
            out.extend(line for line in answer.iter_lines() if line.startswith("data: "))
    except httpx.HTTPError as exc:
        out.append(f"cut: {exc!r}")


def _until(check, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_sigint_to_the_server_alone_ends_open_streams_with_an_error_event(tmp_path: Path):
    proc, port = serve_logged(tmp_path / "serve.log", "--kv-cache-mb", "64")
    try:
        wait_healthy(port, 180.0)
        streams: list[list[str]] = [[] for _ in range(3)]
        clients = [threading.Thread(target=_stream, args=(port, out), daemon=True) for out in streams]
        for client in clients:
            client.start()
        _until(lambda: all(streams), "the streams never started", 60.0)
        proc.send_signal(signal.SIGINT)  # the server's pid only (a Ctrl-C there): the workers get no signal
        assert proc.wait(60) == -signal.SIGINT  # as signalled (a KeyboardInterrupt made it 0)
        for client in clients:
            client.join(30)
        for out in streams:
            assert out[-1] == "data: [DONE]", out[-3:]
            last = json.loads(out[-2].removeprefix("data: "))
            assert last["error"]["code"] == "shutdown", last
            chunks = [json.loads(line.removeprefix("data: ")) for line in out[:-2]]
            tokens = sum(len(c["choices"][0]["token_ids"]) for c in chunks)
            assert 0 < tokens < MAX_TOKENS  # before: every stream ran to its length
        _until(lambda: not group_members(proc.pid), "a worker outlived the server", 20.0)
    finally:
        stop(proc)


def _completed(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    match = re.search(r'^pdserve_requests_total\{result="completed"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("second", [False, True], ids=["one signal", "then a storm of SIGTERMs"])
def test_a_response_that_cannot_be_written_holds_the_stop_only_until_its_grace_or_a_second_signal(tmp_path: Path, second):
    """The stop waits for open responses; one whose client reads nothing cannot end: its connection
    is cut STOP_GRACE_S into the stop (quietly, as a client's disconnect), and a second signal
    meanwhile ends the process at once, the workers killed first."""
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, "--kv-cache-mb", "64", "--max-logprobs", "259",
                              "--response-write-timeout-s", "600")
    try:
        wait_healthy(port, 180.0)
        body = json.dumps({"model": "tiny", "prompt": "x", "n": 4, "max_tokens": 800, "logprobs": 259,
                           "ignore_eos": True, "stream": True}).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1)
            assert head.startswith(b"HTTP/1.1 200"), head
            # read nothing until generation ends: ~9 MB of events, more than the socket buffers hold
            # (tests/api/test_slow_reader_served.py bounds them), so the response cannot be finished
            _until(lambda: _completed(port) >= 1, "the request never completed", 300.0)
            proc.send_signal(signal.SIGTERM)
            if second:
                time.sleep(0.5)
                forced = time.monotonic()
                for _ in range(10):  # a supervisor that insists: one forced stop, logged once
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
                    time.sleep(0.01)
            # before: the response waited for --response-write-timeout-s, and a second signal was ignored
            assert proc.wait(60) == -signal.SIGTERM
            if second:
                assert time.monotonic() - forced < STOP_GRACE_S  # ended by the signal, not by the grace
        said = log_path.read_text()
        assert said.count("a second SIGTERM during the stop") == int(second), said[-2000:]
        assert "Traceback" not in said, said[-3000:]
        _until(lambda: not group_members(proc.pid), "a worker outlived the server", 20.0)
    finally:
        stop(proc)
