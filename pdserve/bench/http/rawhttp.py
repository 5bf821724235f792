"""A minimal keep-alive HTTP/1.1 client for streaming POSTs.

Why it exists: on a small machine httpx spends several milliseconds of CPU per streamed request
(httpcore, anyio and h11 layers), so at a few hundred requests/s the client itself queues and
adds its own delay to every TTFT it measures. This client does only what the benchmark needs:
POST a JSON body and stream the response's body lines. Plain TCP runs on `stampedsock`, so each
line carries the kernel's arrival time of the bytes that completed it, not the moment Python got
round to reading them; over TLS (asyncio's transport) a line is stamped when its bytes are read.

Contract: `post_lines` yields a `RawResponse` whose `lines` yields ``(time_s, text_line)``. A
connection goes back to the pool only after its body ended cleanly. A request whose reused
connection closes before any response byte (the server's keep-alive timeout racing the send) is
sent once more on a new connection. A connection that closes mid-response raises
`ConnectionError`; callers bound time with `asyncio.timeout`.
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

from pdserve.bench.http.httpparse import ResponseParser
from pdserve.bench.http.stampedsock import StampedStream, connect


@dataclass(frozen=True)
class RawResponse:
    """Status and lower-cased headers; `lines` yields (perf_counter seconds, body line)."""

    status: int
    headers: dict[str, str]
    lines: AsyncIterator[tuple[float, str]]


class _Connection:
    """One TCP connection carrying one request at a time; bytes arrive through `feed`."""

    def __init__(self) -> None:
        self.writer: StampedStream | asyncio.Transport | None = None
        self.parser = ResponseParser()
        self.closed = False
        self._lines: deque[tuple[float, str]] = deque()
        self._waiter: asyncio.Future | None = None

    def feed(self, stamp_s: float, data: bytes) -> None:
        """Bytes that arrived at `stamp_s` (perf_counter seconds)."""
        try:
            lines = self.parser.feed(data)
        except ConnectionError:
            self.close()
            self._wake()
            return
        self._lines.extend((stamp_s, line) for line in lines)
        self._wake()

    def lost(self) -> None:
        """The peer closed the connection or it failed."""
        now_s = time.perf_counter()
        self.closed = True
        self._lines.extend((now_s, line) for line in self.parser.feed_eof())
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.writer is not None:
            self.writer.close()

    def send(self, request: bytes) -> None:
        self.parser = ResponseParser()
        self._lines.clear()
        self.writer.write(request)

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


class _TlsProtocol(asyncio.Protocol):
    """TLS goes through asyncio's transport; its bytes are stamped when the loop reads them."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        self.conn.feed(time.perf_counter(), data)

    def connection_lost(self, exc) -> None:
        self.conn.lost()


SPARE_CONNECTIONS = 2


class RawHttpClient:
    """Pooled connections to one origin (scheme://host:port).

    The pool keeps `spare` idle connections open ahead of demand (opened in the background when a
    request takes one), so a burst of arrivals does not put TCP connection set-up inside the
    TTFT the benchmark measures.
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, spare: int = SPARE_CONNECTIONS) -> None:
        parts = urlsplit(base_url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)
        self._headers = headers or {}
        self._idle: list[_Connection] = []
        self._spare = spare
        self._opening: set[asyncio.Task] = set()

    @asynccontextmanager
    async def post_lines(self, path: str, body: dict, headers: dict[str, str] | None = None):
        """POST `body` as JSON to `path`; yields a RawResponse whose lines stream the body."""
        request = self._request_bytes(path, body, headers or {})
        conn, reused = await self._connection()
        reusable = False
        try:
            try:
                conn.send(request)
                await conn.wait_head()
            except ConnectionError:
                if not reused or conn.parser.started:
                    raise
                # the server closed this idle connection as we sent (a keep-alive timeout): it saw
                # no request, so send it once more on a new connection
                conn.close()
                conn = await self._open()
                conn.send(request)
                await conn.wait_head()
            parser = conn.parser
            yield RawResponse(parser.status, parser.headers, conn.lines())
            reusable = parser.complete and parser.headers.get("connection", "").lower() != "close"
        finally:
            self._release(conn, reusable)

    async def aclose(self) -> None:
        """Stop opening spares and close every idle connection."""
        for task in list(self._opening):
            task.cancel()
        await asyncio.gather(*self._opening, return_exceptions=True)
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _connection(self) -> tuple[_Connection, bool]:
        """A connection for one request and whether it was reused from the pool."""
        conn = None
        while self._idle and conn is None:
            conn = self._idle.pop()
            conn = None if conn.closed else conn
        self._top_up()
        return (conn, True) if conn is not None else (await self._open(), False)

    def _top_up(self) -> None:
        while len(self._idle) + len(self._opening) < self._spare:
            task = asyncio.get_running_loop().create_task(self._open_spare())
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)

    async def _open_spare(self) -> None:
        try:
            conn = await self._open()
        except OSError:  # the request that needs a connection will open one and report the error
            return
        self._idle.append(conn)

    async def _open(self) -> _Connection:
        conn = _Connection()
        if self._tls:
            loop = asyncio.get_running_loop()
            context = ssl.create_default_context()
            conn.writer, _ = await loop.create_connection(lambda: _TlsProtocol(conn), self._host, self._port, ssl=context)
        else:
            conn.writer = await connect(self._host, self._port, conn.feed, conn.lost)
        return conn

    def _release(self, conn: _Connection, reusable: bool) -> None:
        if reusable and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()

    def _request_bytes(self, path: str, body: dict, headers: dict[str, str]) -> bytes:
        data = json.dumps(body, separators=(",", ":")).encode()
        lines = [f"POST {path} HTTP/1.1", f"Host: {self._host}:{self._port}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in {**self._headers, **headers}.items()]
        lines += [f"Content-Length: {len(data)}", "", ""]
        return "\r\n".join(lines).encode("latin-1") + data
