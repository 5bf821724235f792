"""The two HTTP transports the benchmark client can stream through.

Contract: a transport's `post_lines(path, body, headers)` is an async context manager yielding an
object with `status` (int) and `lines` (async iterator of ``(perf_counter seconds, body text
line)``, stamped as early as the transport can); leaving the context
releases or closes the connection. Transports raise their own errors; `client.classify_error`
maps both families to the benchmark's error names.

- "raw" (default): `rawhttp.RawHttpClient`, plain asyncio, lowest client overhead;
- "httpx": httpx.AsyncClient with unlimited pool size, for servers that need a full HTTP stack
  (proxies are not used either way: `trust_env=False`).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Protocol

from pdserve.bench.http.rawhttp import RawHttpClient, RawResponse

HTTP_CLIENTS = ("raw", "httpx")


class Transport(Protocol):
    """What `send_request` needs from an HTTP client."""

    def post_lines(self, path: str, body: dict, headers: dict[str, str]): ...

    async def aclose(self) -> None: ...


class HttpxTransport:
    """httpx behind the Transport interface."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._client = httpx.AsyncClient(
            base_url=base_url, headers=headers, limits=limits, timeout=httpx.Timeout(timeout_s), trust_env=False
        )

    @asynccontextmanager
    async def post_lines(self, path: str, body: dict, headers: dict[str, str]):
        async with self._client.stream("POST", path, json=body, headers=headers) as response:
            yield RawResponse(response.status_code, dict(response.headers), _stamped(response.aiter_lines()))

    async def aclose(self) -> None:
        await self._client.aclose()


async def _stamped(lines):
    async for line in lines:
        yield time.perf_counter(), line


def make_transport(kind: str, base_url: str, headers: dict[str, str], timeout_s: float) -> Transport:
    """A transport of `kind` ("raw" or "httpx") for `base_url`."""
    if kind == "raw":
        return RawHttpClient(base_url, headers)
    if kind == "httpx":
        return HttpxTransport(base_url, headers, timeout_s)
    raise ValueError(f"http client must be one of {HTTP_CLIENTS}")
