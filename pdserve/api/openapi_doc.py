"""The OpenAPI schema documents every answer the server gives.

Contract: each route declares its error statuses with the OpenAI error body (`ErrorBody`) through
`errors(...)`; `install(app)` makes the generated schema say what the server does: FastAPI's
automatic 422 (this server answers validation errors with 400, errors.py) becomes a documented
400, every operation documents the 500 the last-resort handler answers, and `/metrics` is
text/plain. A schemathesis run over this schema (tests/api/test_openapi_conformance.py) checks
that the server answers only what is documented.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

DESCRIPTIONS = {
    400: "Invalid request: the OpenAI error object names the offending parameter",
    401: "Missing or wrong admin bearer token",
    404: "Unknown model (or, for any path, an unknown route)",
    409: "The release state does not allow this, or another admin operation is running",
    429: "Rate limited (Retry-After header)",
    500: "Internal error (the server keeps serving)",
    503: "No capacity, no healthy workers, or shutting down (Retry-After header)",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


def errors(*statuses: int) -> dict:
    """`responses=` for a route that can answer these error statuses."""
    return {status: {"model": ErrorBody, "description": DESCRIPTIONS[status]} for status in statuses}


METRICS_RESPONSE = {200: {"description": "Prometheus text exposition format",
                          "content": {"text/plain": {"schema": {"type": "string"}}}}}
# OpenAPI 3.0/3.1 have no itemSchema: a text/event-stream schema describes one parsed event (as 3.2's
# itemSchema and schemathesis read it), its `data` a JSON chunk of the completion, the last one [DONE]
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a JSON chunk; the last event's is [DONE]"},
                            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
SSE_CONTENT = {"text/event-stream": {"schema": SSE_EVENT,
                                     "description": "with \"stream\": true: server-sent events, ending with data: [DONE]"}}


def install(app: FastAPI) -> None:
    """Replace the app's schema generator with one that documents what the server answers."""

    def schema() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = _rewrite(doc)
        return app.openapi_schema

    app.openapi = schema


def _rewrite(doc: dict) -> dict:
    error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            answers = operation.setdefault("responses", {})
            validation = answers.pop("422", None)
            if validation is not None:
                answers.setdefault("400", {"description": DESCRIPTIONS[400], "content": error_ref})
            answers.setdefault("500", {"description": DESCRIPTIONS[500], "content": error_ref})
            if path in ("/v1/completions", "/v1/chat/completions"):
                answers["200"].setdefault("content", {}).update(SSE_CONTENT)
    schemas = doc.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(_error_schemas(schemas))
    return doc


def _error_schemas(existing: dict) -> dict:
    if "ErrorBody" in existing:
        return {}
    body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    body.pop("$defs", None)
    return {"ErrorBody": body, "ErrorDetail": ErrorDetail.model_json_schema()}
