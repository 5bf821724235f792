"""The event loop pdserve's processes run on: the server (router, HTTP), the benchmark client, the stand-in.

Contract: `run(coro)` runs `coro` to completion on a fresh loop: uvloop's (libuv-based) when it
is installed, else asyncio's own. Every streamed token crosses the server's loop a few times (its
worker message, its HTTP write) and every client event is a TTFT measurement, so the cheaper loop
is used where available.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:  # a dependency on Linux and macOS; optional so pdserve still runs without it
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - depends on the platform
    _uvloop = None


def run(coro: Coroutine[Any, Any, T]) -> T:
    if _uvloop is not None:
        return _uvloop.run(coro)
    return asyncio.run(coro)
