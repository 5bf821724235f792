"""Turns one request's backend events into an HTTP answer: a whole JSON body or an SSE stream.

Contract: both paths start from the first event, already read by `RequestStream.open()`, and fold
events into the request's `Choices` (choices.py: n choices, echo, logprobs).
- `collect` reads to the terminal event; an ErrorEvent raises `ApiError` (status from its code).
- `sse_events` yields the OpenAI stream (see responses.py) and then `data: [DONE]`. An ErrorEvent
  after the stream began becomes one `data: {"error": {...}}` event before `[DONE]`, so a client
  can always tell a failed stream from a finished one; so does a backend iterator that raises.
  Every token event is sent, also when its text is empty (a token whose text the detokenizer holds
  back, e.g. part of a UTF-8 character, or a special token), as vLLM does: a client that keeps up
  sees one event per decode step, so its TTFT and inter-token times are the generation's, not the
  text's. A client that lags far behind (it stopped reading) gets fewer, larger events with the
  same content: the router merges a choice's tokens past a margin of events waiting for it
  (router/process/output_collector.py).
- `EventStreamResponse` closes the `RequestStream` when the response ends for any reason (normal
  end, client disconnect, cancellation, error), so an abandoned request is always aborted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.api.backend import ErrorEvent, FinishEvent, GenerationEvent, TokenEvent
from pdserve.api.choices import Choices
from pdserve.api.errors import from_event_code
from pdserve.api.lifecycle import RequestStream
from pdserve.api.responses import DONE_EVENT, FullChoice, ResponseFormat, Usage, sse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Collected:
    choices: list[FullChoice]
    usage: Usage


async def collect(stream: RequestStream, first: GenerationEvent, choices: Choices) -> Collected:
    """Aggregate the whole output; raise `ApiError` on an ErrorEvent."""
    event = first
    while isinstance(event, TokenEvent):
        choices.take(event)
        event = await stream.next()
    if isinstance(event, ErrorEvent):
        raise from_event_code(event.message, event.code)
    choices.finish(event)
    return Collected(choices.whole(), choices.usage(event))


async def sse_events(stream: RequestStream, first: GenerationEvent, fmt: ResponseFormat,
                     choices: Choices) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response; closes `stream` when it ends."""
    try:
        for chunk in fmt.opening(len(choices.choices)):
            yield sse(chunk)
        event = first
        while isinstance(event, TokenEvent):
            piece = choices.take(event)
            if piece is not None:
                yield fmt.delta_event(piece.text, piece.token_ids, piece.index, piece.logprobs)
            if choices.closes(event):
                yield sse(fmt.closing("", choices.choices[event.index].finish_reason, event.index))
            event = await _next_or_error(stream)
        for chunk in _ending(event, fmt, choices):
            yield chunk
        yield DONE_EVENT
    finally:
        await stream.close()


async def _next_or_error(stream: RequestStream) -> GenerationEvent:
    """Headers are sent: a backend that raises must still end the stream with an error event."""
    try:
        return await stream.next()
    except Exception as exc:
        log.exception("backend failed mid-stream for %s", stream.request_id)
        return ErrorEvent(f"the backend failed: {type(exc).__name__}: {exc}", code="internal_error")


def _ending(event: FinishEvent | ErrorEvent, fmt: ResponseFormat, choices: Choices) -> list[bytes]:
    if isinstance(event, ErrorEvent):
        return [sse(_stream_error(event))]
    chunks = [sse(fmt.closing(p.text, choices.choices[p.index].finish_reason, p.index)) for p in choices.finish(event)]
    if fmt.include_usage:
        chunks.append(sse(fmt.usage_chunk(choices.usage(event))))
    return chunks


def _stream_error(event: ErrorEvent) -> dict:
    return from_event_code(event.message, event.code).info.body()


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` response that closes its `RequestStream` on every exit path."""

    def __init__(self, stream: RequestStream, content: AsyncIterator[bytes]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.request_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.request_stream.close()
