"""Ties one request's life in the backend to its HTTP client: submit, read events, abort when abandoned.

Life cycle of a `RequestStream`:

    open()   submit + wait for the first event. `Rejection` / `InvalidRequest` raised here mean the
             request was never admitted (nothing to abort).
    next()   the following events, until a terminal one (FinishEvent / ErrorEvent).
    close()  on every exit path. It calls `backend.abort(request_id)` exactly once when the request
             was admitted and the backend never reported its end (client gone, cancellation, an
             error in the HTTP layer, a backend stream that ended without a terminal event), and
             never otherwise. Idempotent; the abort runs in its own task, so cancelling the
             caller (a client disconnect cancels the streaming task) cannot interrupt it.

`until_disconnected(request, work)` awaits `work` unless the client hangs up first, in which case
it cancels `work` and raises `ClientDisconnected`; the server does not cancel a handler by itself
when an HTTP/1.1 client leaves, so the wait for the first token and non-streamed generation use it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from pdserve.api.backend import Backend, ErrorEvent, GenerationEvent, GenerationRequest, TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")

_CLEANUP_TASKS: set[asyncio.Task] = set()  # strong references until each cleanup finishes


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


class RequestStream:
    def __init__(self, backend: Backend, request: GenerationRequest):
        self.backend = backend
        self.request = request
        self._events: AsyncIterator[GenerationEvent] | None = None
        self._admitted = False
        self._ended = False  # the backend reported a terminal event
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def open(self) -> GenerationEvent:
        """Submit and return the first event; not-admitted errors propagate."""
        self._events = aiter(self.backend.submit(self.request))
        self._admitted = True
        try:
            return await self.next()
        except Exception:
            self._admitted = False  # raised before any event: the backend did not admit it
            raise

    async def next(self) -> GenerationEvent:
        assert self._events is not None, "open() first"
        try:
            event = await anext(self._events)
        except StopAsyncIteration:
            return ErrorEvent("the backend ended the stream without a finish", code="incomplete_stream")
        self._ended = not isinstance(event, TokenEvent)
        return event

    async def close(self) -> None:
        """Abort if still live (exactly once overall); release the backend's iterator."""
        if self._closed:
            return
        self._closed = True
        task = asyncio.ensure_future(self._cleanup(self._admitted and not self._ended))
        _CLEANUP_TASKS.add(task)
        task.add_done_callback(_CLEANUP_TASKS.discard)
        await asyncio.shield(task)

    async def _cleanup(self, abort: bool) -> None:
        if abort:
            try:
                await self.backend.abort(self.request_id)
            except Exception:
                log.exception("abort of %s failed", self.request_id)
        closer = getattr(self._events, "aclose", None)
        if closer is not None:
            try:
                await closer()
            except Exception:  # e.g. the iterator is still running in a cancelled task
                log.debug("closing the event iterator of %s failed", self.request_id, exc_info=True)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is not None:  # cannot watch: just wait
            log.warning("disconnect watch failed: %r", watcher.exception())
            await asyncio.wait({task})
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # never leave `work` running beside the caller's cleanup
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
