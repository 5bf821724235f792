"""A stand-in OpenAI-compatible streaming server with exactly controlled timing and faults.

Used by the tests and by `pdserve bench-client` to check the benchmark's arithmetic and the
client's own measurement error. It is a raw asyncio HTTP/1.1 server (keep-alive, chunked SSE), so
its timing is not blurred by a web framework.

Behaviour, per generation request (POST /v1/completions or /v1/chat/completions):

- prompt tokens: text is one token per UTF-8 byte plus `bos_tokens` (a byte-level tokenizer); a
  list of ids counts its length; chat counts the bytes of all message contents plus `bos_tokens`;
- it emits exactly `max_tokens` tokens (default `default_max_tokens`), one byte-token per SSE
  chunk, ignoring EOS; the first token is written `first_token_s + prefill_s_per_token * prompt
  tokens` after the request was read, and token k at that time plus k * `inter_token_s`;
- with `stream_options.include_usage` it sends a final usage chunk, then ``data: [DONE]``;
- the n-th generation request (1-based, counted in order of receipt) gets HTTP 500 when
  `fail_every` divides n; otherwise its stream is cut (connection closed mid-stream after half
  its tokens) when `cut_off_every` divides n; beyond `max_concurrency` streams in flight a
  request is rejected with HTTP 429.

GET /v1/models lists `model`; GET /standin/stats returns, per ``x-request-id`` header seen, the
server-side TTFT it actually achieved, in seconds: from the kernel's arrival stamp of the request
head (`stampedsock`; the stand-in's own scheduling lag is part of its TTFT, as in a real server)
to the first token handed to the kernel. Timers count from that arrival stamp too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from pdserve.loop import run as run_loop
from pdserve.bench.http.stampedsock import StampedStream
from pdserve.heap import frozen_heap

_REASONS = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}


@dataclass(frozen=True)
class StandinConfig:
    """Timing and fault injection of the stand-in (seconds; 0 disables a fault)."""

    first_token_s: float = 0.0
    prefill_s_per_token: float = 0.0
    inter_token_s: float = 0.0
    default_max_tokens: int = 16
    max_concurrency: int = 0
    fail_every: int = 0
    cut_off_every: int = 0
    bos_tokens: int = 1
    model: str = "standin"


@dataclass
class _State:
    """Mutable per-server counters (one event loop, so no locking)."""

    num_requests: int = 0
    in_flight: int = 0
    server_ttft_s: dict[str, float] = field(default_factory=dict)


class _Cut(Exception):
    """Raised to drop the connection mid-stream."""


def prompt_tokens(body: dict, config: StandinConfig) -> int:
    """Prompt length under the stand-in's byte-level tokenizer."""
    if "messages" in body:
        return sum(len(str(m.get("content", "")).encode()) for m in body["messages"]) + config.bos_tokens
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).encode()) + config.bos_tokens


class _Connection:
    """One accepted socket: buffered reads that remember the kernel arrival time of the last one."""

    def __init__(self, sock: socket.socket) -> None:
        self.buffer = bytearray()
        self.stamp_s = 0.0
        self.gone = False
        self._waiter: asyncio.Future | None = None
        self.writer = StampedStream(sock, self._data, self._lost)

    async def readuntil(self, separator: bytes) -> bytes:
        while (end := self.buffer.find(separator)) < 0:
            await self._more()
        return self._take(end + len(separator))

    async def readexactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._more()
        return self._take(size)

    def _take(self, size: int) -> bytes:
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def _more(self) -> None:
        if self.gone:
            raise ConnectionError("client went away")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _data(self, stamp_s: float, data: bytes) -> None:
        self.buffer += data
        self.stamp_s = stamp_s
        self._wake()

    def _lost(self) -> None:
        self.gone = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class StandinServer:
    """The listening socket and its accept loop; `port` is the bound port."""

    def __init__(self, config: StandinConfig, host: str, port: int) -> None:
        self.config = config
        self.state = _State()
        self._listener = socket.create_server((host, port), backlog=1024)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._handlers: set[asyncio.Task] = set()

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                sock, _ = await loop.sock_accept(self._listener)
                task = asyncio.create_task(self._handle(_Connection(sock)))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)
        finally:
            self._listener.close()

    async def _handle(self, conn: _Connection) -> None:
        try:
            while await _serve_one(conn, conn.writer, self.config, self.state):
                pass
        except (_Cut, ConnectionError):
            pass
        finally:
            conn.writer.close()


async def _serve_one(reader: _Connection, writer: StampedStream, config: StandinConfig, state: _State) -> bool:
    """Handle one request on a keep-alive connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    received_s = reader.stamp_s  # when the head's last bytes reached the kernel
    method, path, headers = _parse_head(head)
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    if method == "GET" and path == "/v1/models":
        _write_json(writer, 200, {"object": "list", "data": [{"id": config.model, "object": "model"}]})
    elif method == "GET" and path == "/standin/stats":
        _write_json(writer, 200, {"num_requests": state.num_requests, "server_ttft_s": state.server_ttft_s})
    elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
        await _generate(writer, json.loads(body or b"{}"), headers, received_s, config, state)
    else:
        _write_json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
    await writer.drain()
    return True


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


async def _generate(writer, body: dict, headers: dict, received_s: float, config, state: _State) -> None:
    state.num_requests += 1
    n = state.num_requests
    if config.fail_every and n % config.fail_every == 0:
        _write_json(writer, 500, {"error": {"message": "injected failure"}})
        return
    if config.max_concurrency and state.in_flight >= config.max_concurrency:
        _write_json(writer, 429, {"error": {"message": "too many requests in flight"}})
        return
    state.in_flight += 1
    try:
        cut = bool(config.cut_off_every and n % config.cut_off_every == 0)
        await _stream(writer, body, headers.get("x-request-id", str(n)), received_s, cut, config, state)
    finally:
        state.in_flight -= 1


async def _stream(writer, body: dict, request_id: str, received_s: float, cut: bool, config, state) -> None:
    chat = "messages" in body
    num_prompt = prompt_tokens(body, config)
    num_out = max(1, int(body.get("max_tokens") or config.default_max_tokens))
    first_s = received_s + config.first_token_s + config.prefill_s_per_token * num_prompt
    if not body.get("stream"):
        await _sleep_until(first_s + (num_out - 1) * config.inter_token_s)
        _write_json(writer, 200, _full_response(chat, num_out, num_prompt, config))
        return
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    for k in range(num_out):
        if cut and k >= num_out // 2:
            await writer.drain()
            raise _Cut()
        await _sleep_until(first_s + k * config.inter_token_s)
        _write_event(writer, _token_chunk(chat, k, num_out, config))
        if k == 0:
            state.server_ttft_s[request_id] = time.perf_counter() - received_s
        await writer.drain()
    if (body.get("stream_options") or {}).get("include_usage"):
        _write_event(writer, {"object": "usage", "choices": [], "usage": _usage(num_prompt, num_out)})
    _write_event(writer, "[DONE]")
    writer.write(b"0\r\n\r\n")


async def _sleep_until(deadline_s: float) -> None:
    """Sleep until perf_counter reaches `deadline_s`, never less: uvloop rounds timers to whole
    milliseconds from a cached loop time, so one sleep can wake up to ~0.5 ms early; sleep again
    for what is left (a sub-millisecond rest is a few zero-delay yields)."""
    while (delay_s := deadline_s - time.perf_counter()) > 0:
        await asyncio.sleep(delay_s)


def _token_chunk(chat: bool, k: int, num_out: int, config: StandinConfig) -> dict:
    text = chr(ord("a") + k % 26)
    finish = "length" if k == num_out - 1 else None
    if chat:
        choice = {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"object": "chat.completion.chunk", "model": config.model, "choices": [choice]}
    return {"object": "text_completion", "model": config.model, "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _full_response(chat: bool, num_out: int, num_prompt: int, config: StandinConfig) -> dict:
    text = "".join(chr(ord("a") + k % 26) for k in range(num_out))
    choice = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"model": config.model, "choices": [choice], "usage": _usage(num_prompt, num_out)}


def _usage(num_prompt: int, num_out: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


def _write_event(writer, payload) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    event = f"data: {data}\n\n".encode()
    writer.write(b"%x\r\n%s\r\n" % (len(event), event))


def _write_json(writer, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    writer.write(head.encode() + data)


class StandinProcess:
    """Run the stand-in in a child interpreter (its own core, no shared GIL); a context manager.

    `url` is the base URL (``http://127.0.0.1:PORT``) once entered.
    """

    def __init__(self, config: StandinConfig, port: int = 0) -> None:
        self.config = config
        self.port = port
        self.url = ""
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> StandinProcess:
        argv = [sys.executable, "-m", "pdserve.bench.standin", "--port", str(self.port)]
        argv += ["--config-json", json.dumps(asdict(self.config))]
        self._process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        line = self._process.stdout.readline()
        if not line.startswith("stand-in serving on "):
            self.__exit__(None, None, None)
            raise RuntimeError("stand-in server did not start")
        self.url = line.split()[-1]
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._process.stdout.close()
            self._process = None


def main(argv: list[str] | None = None) -> None:
    """`python -m pdserve.bench.standin --port 8000 --first-token-ms 50 --inter-token-ms 10`."""
    parser = argparse.ArgumentParser(description="stand-in OpenAI-compatible streaming server")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--first-token-ms", type=float, default=0.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    parser.add_argument("--inter-token-ms", type=float, default=0.0)
    parser.add_argument("--max-concurrency", type=int, default=0)
    parser.add_argument("--config-json", help="a whole StandinConfig as JSON (overrides the flags)")
    args = parser.parse_args(argv)
    config = StandinConfig(
        first_token_s=args.first_token_ms / 1e3,
        prefill_s_per_token=args.prefill_ms_per_token / 1e3,
        inter_token_s=args.inter_token_ms / 1e3,
        max_concurrency=args.max_concurrency,
    )
    if args.config_json:
        config = StandinConfig(**json.loads(args.config_json))

    async def run() -> None:
        server = StandinServer(config, "127.0.0.1", args.port)
        port = server.port
        print(f"stand-in serving on http://127.0.0.1:{port}", flush=True)
        with frozen_heap():  # start-up objects stay out of later collections: no long pauses mid-stream
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        run_loop(run())


if __name__ == "__main__":
    main()
