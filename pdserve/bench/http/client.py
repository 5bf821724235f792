"""Sending one benchmark request over HTTP and timing its stream.

Contract: `send_request` never raises for a server-side or transport problem: every outcome
becomes a `RequestRecord`. Timing starts just before the request is handed to the transport (see
`transport.py`); each token time is the moment the transport received its line, before any JSON
parsing. A request succeeds only with HTTP 200, a stream that ends with ``data: [DONE]`` and at
least one token chunk. Otherwise `error` is ``rejected:<status>`` (429, 503),
``http:<status>`` (other statuses), ``timeout``, ``connect_error``, ``cut_off`` (connection closed
or stream ended without [DONE]), ``stream_error`` (an error chunk) or ``no_output``. Output tokens
are the server's usage count when sent (we ask for it with ``stream_options.include_usage``),
else the number of token chunks (see sse.py: a chunk with text, or with an empty text field and
no finish reason, e.g. a token whose text the server holds back).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.api.protocol import SCRIPTED_EOS_HEADER  # the server side of the hook
from pdserve.bench.records import RequestRecord
from pdserve.bench.http.sse import StreamEvent, parse_sse_line
from pdserve.bench.http.transport import Transport, make_transport
from pdserve.bench.workload import BenchRequest

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REJECT_STATUSES = (429, 503)


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send requests."""

    base_url: str
    model: str
    api: str = "completions"
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    api_key: str | None = None
    http_client: str = "raw"
    max_tokens: int | None = None  # set: every request asks for this many, and ends at its own length (scripted EOS)


def request_body(request: BenchRequest, endpoint: EndpointConfig) -> dict:
    """The JSON body: streaming, usage requested, output pinned by max_tokens (+ ignore_eos)."""
    body: dict = {
        "model": endpoint.model,
        "max_tokens": request.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.max_tokens is not None:  # the bound the server reserves for; the trace's length ends it (header)
        body["max_tokens"] = endpoint.max_tokens
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    if endpoint.api == "chat":
        body["messages"] = request.chat_messages()
    else:
        prompt = request.prompt
        body["prompt"] = list(prompt) if isinstance(prompt, tuple) else prompt
    return body


def request_headers(request: BenchRequest, endpoint: EndpointConfig, request_id: str) -> dict[str, str]:
    """The request's headers: its id, and with `max_tokens` pdserve's scripted end of sequence at
    the request's own length (a header, outside the OpenAI body: another server ignores it, and
    `scripted_eos_ignored` then counts the requests that ran past it)."""
    headers = {"x-request-id": request_id}
    if endpoint.max_tokens is not None:
        headers[SCRIPTED_EOS_HEADER] = str(request.output_tokens)
    return headers


def scripted_eos_ignored(records, requests) -> int:
    """Successful requests that streamed more tokens than their scripted end: the server ignored it."""
    return sum(r.success and r.output_tokens > q.output_tokens for r, q in zip(records, requests))


def make_transport_for(endpoint: EndpointConfig) -> Transport:
    """The endpoint's transport; unlimited connections (the client must never queue requests)."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    return make_transport(endpoint.http_client, endpoint.base_url, headers, endpoint.request_timeout_s)


async def discover_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id listed by GET /v1/models."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models")
    return models[0]["id"]


class StreamTimer:
    """Accumulates one stream's events into a record (token times are perf_counter seconds)."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.token_times_s: list[float] = []
        self.usage_tokens: int | None = None
        self.done = False
        self.error = ""
        self.end_s = start_s

    def add(self, event: StreamEvent, now_s: float) -> None:
        self.end_s = now_s
        if event.error:
            self.error = event.error
        if event.token:
            self.token_times_s.append(now_s)
        if event.usage_tokens is not None:
            self.usage_tokens = int(event.usage_tokens)
        self.done = self.done or event.done

    def record(self, request: BenchRequest, run_start_s: float, error: str = "") -> RequestRecord:
        """The record; `error` (a transport failure) overrides what the stream said."""
        times = self.token_times_s
        error = error or self.error or ("" if self.done else "cut_off") or ("" if times else "no_output")
        ttft_s = times[0] - self.start_s if times else None
        return RequestRecord(
            request_id=request.request_id,
            arrival_s=request.arrival_s,
            start_s=self.start_s - run_start_s,
            success=not error,
            ttft_s=ttft_s,
            e2e_s=self.end_s - self.start_s,
            itls_s=tuple(b - a for a, b in zip(times, times[1:])),
            output_tokens=self.usage_tokens if self.usage_tokens is not None else len(times),
            prompt_tokens=request.prompt_tokens,
            error=error,
        )


async def send_request(
    transport: Transport, request: BenchRequest, endpoint: EndpointConfig, run_start_s: float
) -> RequestRecord:
    """Send `request`, read its stream to the end, and time it (bounded by the request timeout)."""
    body = request_body(request, endpoint)
    headers = request_headers(request, endpoint, str(request.request_id))
    timer = StreamTimer(time.perf_counter())
    try:
        async with asyncio.timeout(endpoint.request_timeout_s):
            async with transport.post_lines(API_PATHS[endpoint.api], body, headers) as response:
                if response.status != 200:
                    timer.end_s = time.perf_counter()
                    async for _ in response.lines:  # drain, so the connection can be reused
                        pass
                    return timer.record(request, run_start_s, _status_error(response.status))
                await _read_stream(response.lines, timer)
    except Exception as exc:  # noqa: BLE001 -- every failure must become a record, never a crash
        timer.end_s = time.perf_counter()
        return timer.record(request, run_start_s, classify_error(exc))
    return timer.record(request, run_start_s)


def classify_error(exc: BaseException) -> str:
    """The benchmark's name for a transport failure of either HTTP client."""
    name = type(exc).__name__
    if isinstance(exc, TimeoutError) or name.endswith("Timeout") or "Timeout" in name:
        return "timeout"
    if isinstance(exc, ConnectionRefusedError) or name == "ConnectError":
        return "connect_error"
    return "cut_off"


async def _read_stream(lines, timer: StreamTimer) -> None:
    """Read to the end of the body (so the connection is reused); timing stops at [DONE]."""
    async for now_s, line in lines:
        event = parse_sse_line(line) if not timer.done else None
        if event is not None:
            timer.add(event, now_s)


def _status_error(status: int) -> str:
    return f"rejected:{status}" if status in REJECT_STATUSES else f"http:{status}"
