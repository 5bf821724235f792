"""The HTTP front end: an OpenAI-compatible FastAPI app over any `Backend`.

Routes:
    POST /v1/completions, POST /v1/chat/completions   generation (JSON or SSE with "stream": true)
    POST /tokenize, POST /detokenize                  vLLM's token counting and decoding (tokenize.py)
    GET  /v1/models                                   the one served model
    GET  /health                                      200 when backend.healthy(), else 503
    GET  /metrics                                     the backend's Prometheus text
    GET  /workers                                     backend.workers() as JSON
    /admin/*                                          live disable, rollback, release state (admin.py;
                                                      only with --admin-token)

Life cycle of a generation request: validate and tokenize (protocol.py; a body over
`INLINE_PARSE_BYTES` off the event loop, in a thread: tokenizers release the GIL, and a long
prompt's tokenization would otherwise stall every stream the loop serves) -> id `cmpl-<hex>` / `chatcmpl-<hex>`
-> submit and wait for the first event (lifecycle.py; a `Rejection` here answers 429/503 with
Retry-After) -> aggregate or stream (relay.py). A client that leaves at any point gets its
request aborted in the backend. Every error is an OpenAI error object (errors.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.api.backend import Backend, ErrorEvent
from pdserve.api import openapi_doc
from pdserve.api.errors import from_event_code, install_error_handlers
from pdserve.api.edge.http_guard import DEFAULT_MAX_REQUEST_BODY_BYTES, HttpGuard
from pdserve.api.openapi_doc import METRICS_RESPONSE, errors
from pdserve.api.lifecycle import ClientDisconnected, RequestStream, until_disconnected
from pdserve.api.choices import Choices
from pdserve.api.logprob_format import TokenNames
from pdserve.api.protocol import (
    DEFAULT_MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest, ParsedRequest, ServedModel, parse_chat,
    parse_completion, with_scripted_eos,
)
from pdserve.api.relay import EventStreamResponse, collect, sse_events
from pdserve.api.responses import ChatFormat, ResponseFormat
from pdserve.api.tenants import TenantResolver
from pdserve.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

CLIENT_CLOSED_REQUEST = 499  # nginx's convention; nobody reads it, but logs do
INLINE_PARSE_BYTES = 8192  # larger bodies are validated and tokenized in a thread (a hop costs more than a short prompt)


def create_app(backend: Backend, admin_token: str | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
               api_keys: dict[str, str] | None = None,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """An app serving `backend`; the caller owns the backend's start and close. With
    `admin_token`, the /admin endpoints are mounted (admin.py). `max_logprobs` caps the top
    logprobs a request may ask for (serve --max-logprobs). With `api_keys` (key -> tenant), every
    /v1 route and /tokenize, /detokenize need a key, and generation runs in its tenant
    (tenants.py). Credentials and the body limit are checked before any route reads the body
    (edge/http_guard.py)."""
    app = FastAPI(title="pdserve", summary="Prefill/decode disaggregated LLM serving")
    app.state.backend = backend
    app.state.max_logprobs = max_logprobs
    started = int(time.time())
    install_error_handlers(app)
    openapi_doc.install(app)
    if admin_token is not None:
        from pdserve.api.admin import check_admin_token, install_admin_routes

        install_admin_routes(app, backend, admin_token)

    tenants = TenantResolver(api_keys)  # whose prefix cache a request uses (tenants.py)
    admin_check = None if admin_token is None else (lambda header: check_admin_token(header, admin_token))
    app.add_middleware(HttpGuard, max_body_bytes=max_request_body_bytes, admin=admin_check,
                       api_key=tenants.authenticate if tenants.keyed else None)

    @app.post("/v1/completions", responses=errors(400, 401, 404, 429, 503))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        parsed = await parse_off_loop(parse_completion, body, served_model(backend, max_logprobs), request)
        parsed = tenants.apply(with_scripted_eos(parsed, request.headers), request.headers.get("authorization"),
                               body.cache_salt)
        return await generate(backend, request, parsed, new_format(ResponseFormat, "cmpl", backend, parsed))

    @app.post("/v1/chat/completions", responses=errors(400, 401, 404, 429, 503))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        parsed = await parse_off_loop(parse_chat, body, served_model(backend, max_logprobs), request)
        parsed = tenants.apply(with_scripted_eos(parsed, request.headers), request.headers.get("authorization"),
                               body.cache_salt)
        return await generate(backend, request, parsed, new_format(ChatFormat, "chatcmpl", backend, parsed))

    @app.post("/tokenize", responses=errors(400, 401, 404))
    async def tokenize_route(body: TokenizeRequest) -> dict:
        return tokenize(body, served_model(backend))

    @app.post("/detokenize", responses=errors(400, 401, 404))
    async def detokenize_route(body: DetokenizeRequest) -> dict:
        return detokenize(body, served_model(backend))

    @app.get("/v1/models", responses=errors(401))
    async def models() -> dict:
        card = {"id": backend.model_name, "object": "model", "created": started, "owned_by": "pdserve",
                "max_model_len": backend.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health", responses={503: {"description": "No healthy worker pool (body: {\"status\": \"unhealthy\"})"}})
    async def health() -> JSONResponse:
        ok = backend.healthy()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSE)
    async def metrics() -> Response:
        return Response(backend.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def workers() -> list[dict]:
        return [dataclasses.asdict(w) for w in backend.workers()]

    return app


async def parse_off_loop(parse, body, served: ServedModel, request: Request) -> ParsedRequest:
    """`parse(body, served)`: inline for a short body, in a thread past `INLINE_PARSE_BYTES`."""
    if int(request.headers.get("content-length") or 0) <= INLINE_PARSE_BYTES:
        return parse(body, served)
    return await asyncio.to_thread(parse, body, served)


def served_model(backend: Backend, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> ServedModel:
    return ServedModel(backend.model_name, backend.max_model_len, backend.tokenizer(), max_logprobs)


def new_format(kind: type[ResponseFormat], id_prefix: str, backend: Backend, parsed: ParsedRequest) -> ResponseFormat:
    """The response shape for one request, with a fresh id `<id_prefix>-<uuid hex>`."""
    return kind(f"{id_prefix}-{uuid.uuid4().hex}", backend.model_name, parsed.return_token_ids, parsed.include_usage)


async def generate(backend: Backend, request: Request, parsed: ParsedRequest, fmt: ResponseFormat) -> Response:
    """Submit one request and answer with the whole result or an event stream."""
    stream = RequestStream(backend, parsed.to_generation(fmt.request_id))
    choices = Choices(parsed, fmt, TokenNames(backend.tokenizer()))
    streaming_started = False
    try:
        first = await until_disconnected(request, stream.open())
        if isinstance(first, ErrorEvent):
            raise from_event_code(first.message, first.code)
        if parsed.stream:
            streaming_started = True  # from here the response owns the stream's close()
            return EventStreamResponse(stream, sse_events(stream, first, fmt, choices))
        result = await until_disconnected(request, collect(stream, first, choices))
        return JSONResponse(fmt.response(result.choices, result.usage))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        if not streaming_started:
            await stream.close()
