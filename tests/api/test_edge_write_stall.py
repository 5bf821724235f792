"""A client that sends a request and then reads none of a large answer (api/edge/connections.py):
once the server's send buffers are full and no byte leaves for --response-write-timeout-s, the
connection is dropped, so the app's blocked send returns and the connection's slot and file
descriptor come back. Before, such a client held both forever (and SIGTERM waited on it). A client
that reads slowly, so that writes stay paused for many timeouts in a row, keeps its answer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import uvicorn

from pdserve.api.edge.connections import edge_protocol
from pdserve.api.edge.limits import EdgeLimits

WRITE_TIMEOUT_S = 2.0  # the reader shares the server's event loop: a loaded machine may hold both ~1 s
ANSWER_BYTES = 64 << 20  # far past any kernel's send and receive buffers on loopback
CHUNK = b"x" * (1 << 20)  # a paused write leaves ~1 MiB buffered: a slow reader takes seconds to drain it


class Served:
    """uvicorn with the edge protocol on a free port, its one route answering ANSWER_BYTES."""

    def __init__(self, send_buffer: int = 64 << 10) -> None:
        self.done: float | None = None  # when the app's last send returned
        # a fixed send buffer (accepted sockets inherit it; no autotuning to MiBs): the kernel reports
        # the socket writable again once half of it drained, so a slow reader moves the answer often
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off", interface="asgi3",
                                                    http=edge_protocol(EdgeLimits(write_timeout_s=WRITE_TIMEOUT_S))))

    async def app(self, scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for _ in range(ANSWER_BYTES // len(CHUNK)):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        self.done = time.monotonic()

    async def __aenter__(self) -> Served:
        self.serving = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await self.serving

    def client(self, receive_buffer: int) -> socket.socket:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        client.connect(("127.0.0.1", self.port))
        client.sendall(b"GET / HTTP/1.1\r\nHost: pdserve\r\n\r\n")
        return client


def test_a_client_that_reads_nothing_is_dropped_after_the_write_timeout():
    async def main():
        async with Served() as served:
            client = served.client(4096)  # and never reads
            try:
                start = time.monotonic()
                while served.done is None and time.monotonic() - start < 30:
                    await asyncio.sleep(0.05)
                assert served.done is not None, "the app's send is still blocked on a client that reads nothing"
                for _ in range(100):  # the dropped connection leaves the server's set
                    if not served.server.server_state.connections:
                        break
                    await asyncio.sleep(0.05)
                assert not served.server.server_state.connections
            finally:
                client.close()

    asyncio.run(main())


async def _read_slowly_and_keep_the_answer(served, receive_buffer: int, chunk_bytes: int) -> None:
    """Read `chunk_bytes` every 0.25 s for 3 write timeouts: the server never drops the client."""
    client = served.client(receive_buffer)
    client.setblocking(False)
    try:
        got, start = 0, time.monotonic()
        while time.monotonic() - start < 3 * WRITE_TIMEOUT_S:
            await asyncio.sleep(0.25)
            with contextlib.suppress(BlockingIOError):
                chunk = client.recv(chunk_bytes)
                assert chunk, f"the server dropped a client that reads ({got} bytes read)"
                got += len(chunk)
        assert served.done is None and len(served.server.server_state.connections) == 1
    finally:
        client.close()


def test_a_client_that_reads_slowly_keeps_its_answer_past_many_write_timeouts():
    async def main():
        async with Served() as served:
            await _read_slowly_and_keep_the_answer(served, 64 << 10, 32 << 10)  # ~128 KB/s: the writes stay paused

    asyncio.run(main())


def test_a_client_that_reads_slower_than_half_the_kernel_buffer_per_timeout_keeps_its_answer():
    """The kernel reports the socket writable only once half its send buffer drained (Linux
    autotunes it to 4 MiB): a client reading 16 KB/s drains no such half within a timeout, but
    bytes do leave the kernel's send queue, and that is progress too (nginx's send_timeout)."""
    async def main():
        async with Served(send_buffer=1 << 20) as served:  # the kernel doubles it: ~1 MiB to drain per wakeup
            await _read_slowly_and_keep_the_answer(served, 4096, 4096)

    asyncio.run(main())
