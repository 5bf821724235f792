"""The HTTP edge's first step: authentication, then the request body limit, before any route reads
the body.

Contract: `HttpGuard` is an ASGI middleware around the app. For a request on a guarded path it
checks the credential from the headers alone (`/admin/*` with the admin token; when API keys are
configured, every `/v1` route as vLLM's --api-key guards them, and /tokenize and /detokenize,
which read the model's tokenizer and template: tenants.py), so an unauthenticated request answers
401 whatever its body, and no body is parsed, tokenized or templated for it. Open: /health,
/metrics, /workers and the OpenAPI pages (no body read, no model output: docs/security.md). Then the body
limit: a declared `Content-Length` above `max_body_bytes` answers 413 at once; a body without one
(chunked) is counted while it streams in and answers 413 at the first byte past the limit, not
after reading it all. Every answer is the OpenAI error body (api/errors.py).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException

from pdserve.api.errors import ApiError

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20  # a 128k-token prompt as JSON token ids fits; a flood does not
KEYED_PREFIX = "/v1"  # every OpenAI route: generation and the model list
KEYED_PATHS = ("/tokenize", "/detokenize")  # vLLM's, outside /v1, but they run the tokenizer on the body


def needs_api_key(path: str) -> bool:
    return path == KEYED_PREFIX or path.startswith(KEYED_PREFIX + "/") or path in KEYED_PATHS


class BodyTooLarge(HTTPException):
    """Raised from `receive` past the limit: FastAPI re-raises an HTTPException met while it reads the body."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds {limit} bytes (--max-request-body-bytes)")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds {limit} bytes (--max-request-body-bytes)", code="request_too_large",
                    headers={"Connection": "close"})


class HttpGuard:
    def __init__(self, app, max_body_bytes: int, admin: Callable[[str], None] | None = None,
                 api_key: Callable[[str], None] | None = None):
        """`admin(authorization)` / `api_key(authorization)` raise ApiError(401) for a bad credential."""
        if max_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {max_body_bytes}")
        self.app, self.max_body_bytes = app, max_body_bytes
        self.admin, self.api_key = admin, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._authenticate(scope["path"], headers.get("authorization", ""))
            declared = int(headers.get("content-length", "0") or 0)
        except ApiError as exc:
            await exc.response()(scope, receive, send)
            return
        except ValueError:
            await ApiError(400, "Content-Length is not a number").response()(scope, receive, send)
            return
        if declared > self.max_body_bytes:
            await too_large(self.max_body_bytes).response()(scope, receive, send)
            return
        await self._bounded(scope, receive, send)

    def _authenticate(self, path: str, authorization: str) -> None:
        if self.admin is not None and (path == "/admin" or path.startswith("/admin/")):
            self.admin(authorization)
        elif self.api_key is not None and needs_api_key(path):
            self.api_key(authorization)

    async def _bounded(self, scope, receive, send) -> None:
        """Run the app with a `receive` that stops the body at the limit."""
        seen, started, limit = 0, False, self.max_body_bytes

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            if started:
                raise
            await too_large(limit).response()(scope, receive, send)
