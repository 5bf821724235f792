"""A minimal keep-alive HTTP/1.1 client for streaming POSTs, on an asyncio Protocol.

Why it exists: on a small machine httpx spends several milliseconds of CPU per streamed request
(httpcore, anyio and h11 layers), so at a few hundred requests/s the client itself queues and
adds its own delay to every TTFT it measures. This client does only what the benchmark needs:
POST a JSON body and stream the response's body lines. Bytes are parsed in `data_received`, and
each line is stamped with `time.perf_counter()` at that moment, so the timestamp does not wait
for a coroutine to be scheduled.

Contract: `post_lines` yields a `RawResponse` whose `lines` yields ``(time_s, text_line)``. A
connection goes back to the pool only after its body ended cleanly. A connection that closes
mid-response raises `ConnectionError`; callers bound time with `asyncio.timeout`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdserve.bench.httpparse import ResponseParser


@dataclass(frozen=True)
class RawResponse:
    """Status and lower-cased headers; `lines` yields (perf_counter seconds, body line)."""

    status: int
    headers: dict[str, str]
    lines: AsyncIterator[tuple[float, str]]


class _Connection(asyncio.Protocol):
    """One TCP connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()
        self.closed = False
        self._lines: deque[tuple[float, str]] = deque()
        self._waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now_s = time.perf_counter()
        try:
            lines = self.parser.feed(data)
        except ConnectionError:
            self.transport.close()
            return
        self._lines.extend((now_s, line) for line in lines)
        self._wake()

    def connection_lost(self, exc) -> None:
        now_s = time.perf_counter()
        self.closed = True
        self._lines.extend((now_s, line) for line in self.parser.feed_eof())
        self._wake()

    def send(self, request: bytes) -> None:
        self.parser = ResponseParser()
        self._lines.clear()
        self.transport.write(request)

    async def wait_head(self) -> None:
        while not self.parser.head_done:
            if self.closed:
                raise ConnectionError("connection closed before the response head")
            await self._wait()

    async def lines(self) -> AsyncIterator[tuple[float, str]]:
        while True:
            while self._lines:
                yield self._lines.popleft()
            if self.parser.complete:
                return
            if self.closed:
                raise ConnectionError("connection closed mid-response")
            await self._wait()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class RawHttpClient:
    """Pooled connections to one origin (scheme://host:port)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)
        self._headers = headers or {}
        self._idle: list[_Connection] = []

    @asynccontextmanager
    async def post_lines(self, path: str, body: dict, headers: dict[str, str] | None = None):
        """POST `body` as JSON to `path`; yields a RawResponse whose lines stream the body."""
        conn = await self._connection()
        reusable = False
        try:
            conn.send(self._request_bytes(path, body, headers or {}))
            await conn.wait_head()
            parser = conn.parser
            yield RawResponse(parser.status, parser.headers, conn.lines())
            reusable = parser.complete and parser.headers.get("connection", "").lower() != "close"
        finally:
            self._release(conn, reusable)

    async def aclose(self) -> None:
        """Close every idle connection."""
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        context = ssl.create_default_context() if self._tls else None
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self._host, self._port, ssl=context)
        return conn

    def _release(self, conn: _Connection, reusable: bool) -> None:
        if reusable and not conn.closed:
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def _request_bytes(self, path: str, body: dict, headers: dict[str, str]) -> bytes:
        data = json.dumps(body, separators=(",", ":")).encode()
        lines = [f"POST {path} HTTP/1.1", f"Host: {self._host}:{self._port}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in {**self._headers, **headers}.items()]
        lines += [f"Content-Length: {len(data)}", "", ""]
        return "\r\n".join(lines).encode("latin-1") + data
