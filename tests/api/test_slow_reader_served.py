"""A streaming client that stops reading while its request generates, then reads the rest
(router/process/output_collector.py): the router merges each choice's tokens once the client lags
far behind instead of queueing one event per token, and the stream's content is the one a fast
reader gets. Before, the router held every generated event for a slow reader (its memory grew
with n x max_tokens x logprobs), and the slow reader got one SSE event per token.

The slow reader reads the response headers, then nothing until /metrics counts the request
completed, then everything. Once its socket buffers are full the server's writes pause, so every
event it got was either written before the pause (at most what the kernel's and uvicorn's buffers
hold, a bound read from this machine's TCP limits) or waited for the reader (at most MAX_SEPARATE
a choice): no assertion depends on how fast the machine generates or reads."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path

from pdserve.router.process.output_collector import MAX_SEPARATE
from tests.api.served_cli import served_cli

N, MAX_TOKENS, TOP = 8, 600, 259
# top-259 logprobs (the tiny model's whole vocabulary) make a one-token event ~2.8 KB: the buffers
# before the pause hold fewer than half of the N x MAX_TOKENS token events
BODY = {"model": "tiny", "prompt": "a slow reader", "n": N, "max_tokens": MAX_TOKENS, "logprobs": TOP, "seed": 1234,
        "temperature": 1.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}}
FLAGS = ("--no-enable-prefix-caching",  # both requests compute the whole prompt: the same usage, the same numbers
         "--response-write-timeout-s", "600",  # the stalled reader reads nothing until generation ends
         "--kv-cache-mb", "64", "--max-logprobs", str(TOP))
RCVBUF = 256 << 10  # fixed (no autotuning), and past loopback's 64 KiB segments so the bulk read is quick
UVICORN_BUFFERED = 256 << 10  # uvicorn's write buffer: its high-water mark (64 KiB) and the event that passed it


def _completed(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(r'^pdserve_requests_total\{result="completed"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def _dechunk(raw: bytes) -> bytes:
    """An HTTP/1.1 chunked body to its bytes."""
    body, at = bytearray(), 0
    while True:
        end = raw.index(b"\r\n", at)
        size = int(raw[at:end].split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body += raw[end + 2 : end + 2 + size]
        at = end + 2 + size + 2


def _stream(port: int, stall: bool) -> bytes:
    """The SSE body of BODY over a raw socket; with `stall`, nothing past the headers is read
    until the server counts the request completed."""
    payload = json.dumps(BODY).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    done_before = _completed(port)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        sock.connect(("127.0.0.1", port))
        sock.sendall(head + payload)
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(1)  # the headers only, a byte at a time
        assert raw.startswith(b"HTTP/1.1 200"), raw
        deadline = time.monotonic() + 300
        while stall and _completed(port) <= done_before:
            assert time.monotonic() < deadline, "the request never completed"
            time.sleep(0.2)
        while piece := sock.recv(4096):
            raw += piece
    return _dechunk(raw.split(b"\r\n\r\n", 1)[1])


def _fold(sse: bytes) -> tuple[dict, dict, list[int]]:
    """(per choice: text, token ids, logprobs lists, finish reason; usage; each delta event's bytes) of a stream."""
    choices: dict[int, dict] = {}
    usage, deltas = None, []
    events = [e[len(b"data: "):] for e in sse.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    for raw in events[:-1]:
        event = json.loads(raw)
        if event["choices"] == []:
            usage = event["usage"]
        for c in event["choices"]:
            out = choices.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None, "tokens": [],
                                                  "token_logprobs": [], "top_logprobs": [], "text_offset": []})
            out["text"] += c["text"]
            out["token_ids"] += c["token_ids"]
            if c["token_ids"]:
                deltas.append(len(raw))
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                out[key] += (c["logprobs"] or {}).get(key, [])
            out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
    return choices, usage, deltas


def _events_before_a_pause(smallest_event: int) -> int:
    """The most delta events the server can write before its writes pause: the kernel's largest
    send buffer, the reader's receive buffer (the kernel doubles what was set) and uvicorn's."""
    send_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    return (send_max + 2 * RCVBUF + UVICORN_BUFFERED) // smallest_event


def test_a_stalled_streaming_reader_gets_the_fast_readers_content_in_merged_events():
    with served_cli(*FLAGS) as (_, port, _):
        fast, fast_usage, _ = _fold(_stream(port, stall=False))
        slow, slow_usage, slow_deltas = _fold(_stream(port, stall=True))
    assert sorted(fast) == list(range(N))
    assert all(len(c["token_ids"]) == MAX_TOKENS and len(c["top_logprobs"]) == MAX_TOKENS for c in fast.values())
    assert all(c["finish_reason"] == "length" for c in fast.values())
    assert fast_usage["completion_tokens"] == N * MAX_TOKENS
    assert slow == fast  # text, token ids, logprobs, finish reasons: byte for byte the same content
    assert slow_usage == fast_usage
    # written before the pause, then what waited for the reader: at most MAX_SEPARATE deltas a
    # choice, the newest merged (before: one event per token)
    bound = _events_before_a_pause(min(slow_deltas)) + N * MAX_SEPARATE + 1
    assert bound <= N * MAX_TOKENS // 2, f"this kernel's buffers hold {bound} events: the test cannot tell merging apart"
    assert len(slow_deltas) <= bound, f"{len(slow_deltas)} delta events for {N * MAX_TOKENS} tokens (at most {bound})"
