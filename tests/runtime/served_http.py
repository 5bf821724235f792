"""The served app over real HTTP on a shared cluster's loop, and a client that can hang up.

`served_app(backend)` runs `create_app(backend)` behind uvicorn on a socket bound here (a port
picked and bound later by uvicorn may be taken first) for the duration of an `async with`;
`open_stream` posts a streamed completion over a plain connection and returns its writer, so a
test closes the connection itself: a real client disconnect, as the server sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import uvicorn

from pdserve.api.app import create_app
from pdserve.engine.sequence import SamplingParams


@contextlib.asynccontextmanager
async def served_app(backend) -> AsyncIterator[int]:
    """The app's port while the block runs."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(backend), log_level="warning"))
    serving = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                raise RuntimeError(f"the app did not start: {serving.exception()!r}")
            await asyncio.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await serving


async def open_stream(port: int, ids, params: SamplingParams) -> asyncio.StreamWriter:
    """A streamed greedy completion of the token ids `ids` over a plain connection; its writer."""
    body = json.dumps({"model": "tiny", "prompt": list(ids), "max_tokens": params.max_tokens, "temperature": 0.0,
                       "ignore_eos": params.ignore_eos, "stream": True}).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    return writer
