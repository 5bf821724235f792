"""A client that sends a request and then reads none of a large answer (api/edge/connections.py):
once the server's send buffers are full and no byte leaves for --response-write-timeout-s, the
connection is dropped, so the app's blocked send returns and the connection's slot and file
descriptor come back. Before, such a client held both forever (and SIGTERM waited on it)."""

from __future__ import annotations

import asyncio
import socket
import time

import uvicorn

from pdserve.api.edge.connections import edge_protocol
from pdserve.api.edge.limits import EdgeLimits
from pdserve.ports import free_local_port

WRITE_TIMEOUT_S = 1.0
ANSWER_BYTES = 64 << 20  # far past any kernel's send and receive buffers on loopback
CHUNK = b"x" * (64 << 10)


def test_a_client_that_reads_nothing_is_dropped_after_the_write_timeout():
    async def main():
        sent = {"done": None}

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for _ in range(ANSWER_BYTES // len(CHUNK)):
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            sent["done"] = time.monotonic()

        port = free_local_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                               http=edge_protocol(EdgeLimits(write_timeout_s=WRITE_TIMEOUT_S))))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            client.sendall(b"GET / HTTP/1.1\r\nHost: pdserve\r\n\r\n")  # and never reads
            start = time.monotonic()
            while sent["done"] is None and time.monotonic() - start < 30:
                await asyncio.sleep(0.05)
            assert sent["done"] is not None, "the app's send is still blocked on a client that reads nothing"
            for _ in range(100):  # the dropped connection leaves the server's set
                if not server.server_state.connections:
                    break
                await asyncio.sleep(0.05)
            assert not server.server_state.connections
        finally:
            client.close()
            server.should_exit = True
            await serving

    asyncio.run(main())
