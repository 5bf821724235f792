"""The event loop the benchmark client and the stand-in run on.

Contract: `run(coro)` runs `coro` to completion on a fresh loop: uvloop's (libuv-based) when it
is installed, else asyncio's own. At hundreds of requests per second on two cores the client's
per-event cost is its TTFT measurement error, so the cheaper loop is used where available.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:  # a dependency on Linux and macOS; optional so the client still runs without it
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - depends on the platform
    _uvloop = None

LOOP_NAME = "uvloop" if _uvloop is not None else "asyncio"


def run(coro: Coroutine[Any, Any, T]) -> T:
    if _uvloop is not None:
        return _uvloop.run(coro)
    return asyncio.run(coro)
