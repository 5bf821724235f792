"""OpenAI-style error responses: one exception type, one body shape, and the app's handlers.

Every error the HTTP layer returns has the body
    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}
including FastAPI's own request-validation errors (malformed JSON, wrong types), which become
400 rather than FastAPI's default 422, and unknown routes (404) and methods (405).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.backend import Rejection
from pdserve.engine.errors import InvalidRequest

log = logging.getLogger(__name__)

# Terminal ErrorEvent codes -> HTTP status when the error arrives before the response started.
# kv_not_visible: the request's workers were lost and no live worker could take it over (the
# decode-start fallback's last step, router/process/recovery.py): the cluster is short, not broken: 503.
STATUS_BY_EVENT_CODE = {"invalid_request": 400, "overloaded": 503, "shutdown": 503, "worker_lost": 503,
                        "kv_not_visible": 503}


@dataclass(frozen=True)
class ApiErrorInfo:
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ApiError(Exception):
    """Raised anywhere in a route to answer with an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.info = ApiErrorInfo(status, message, type, param, code)
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.info.body(), status_code=self.info.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_rejection(exc: Rejection) -> ApiError:
    """429/503 with Retry-After (whole seconds, at least 1)."""
    retry_after = str(max(1, round(exc.retry_after_s)))
    kind = "rate_limit_error" if exc.status == 429 else "service_unavailable_error"
    return ApiError(exc.status, str(exc), type=kind, code=exc.reason, headers={"Retry-After": retry_after})


def from_event_code(message: str, code: str) -> ApiError:
    """An ErrorEvent that ended a request before any output was sent."""
    status = STATUS_BY_EVENT_CODE.get(code, 500)
    kind = "invalid_request_error" if status == 400 else "server_error"
    return ApiError(status, message, type=kind, code=code)


def describe_validation_errors(errors: list[dict]) -> ApiError:
    """Pydantic/FastAPI validation errors -> one 400 naming the first offending field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        reason = ctx.get("error", first.get("msg"))
        return bad_request(f"The request body is not valid JSON: {reason}", code="invalid_json")
    if not loc:
        missing = first.get("type") == "missing"
        return bad_request("The request body is empty; send a JSON object" if missing
                           else "The request body must be a JSON object (Content-Type: application/json)")
    param = ".".join(loc)
    message = f"{param}: {first.get('msg')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error body."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return describe_validation_errors(list(exc.errors())).response()

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return bad_request(str(exc), param=exc.param, code=exc.code).response()

    @app.exception_handler(Rejection)
    async def _rejected(_: Request, exc: Rejection) -> JSONResponse:
        return from_rejection(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = ApiError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the HTTP layer")
        return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").response()
