"""Admin endpoints: live disable/enable of disaggregation, the rollback drill, the release state.

Contract: mounted only when the server is given an admin token (`--admin-token-file FILE` or
$PDSERVE_ADMIN_TOKEN, never argv: commands/serve.py); every call must carry
`Authorization: Bearer T` (compared in constant time; a missing or wrong token answers 401 with
the OpenAI error body, and the token is never logged). The token is checked before the body is
read (api/edge/http_guard.py): an unauthenticated call answers 401 whatever its body. The backend must run a router
(`pdserve serve`); the work itself is router/process/release.py's:

    GET  /admin/state                                   release state, disaggregation, route epoch
    POST /admin/disaggregation  {"enabled": false|true} switch a running cluster to whole requests
                                                        on the same workers, or back
    POST /admin/rollback        no body, or {}          the spec's rollback order, each step timed

Bodies are strict: `enabled` must be a JSON boolean ("yes", 1 or null are refused, not read as
true), unknown fields are refused, and a body sent to /admin/rollback must be an empty object.

Answers: 200 with the operation's record; 400 for a malformed body (and nothing changes); 409
when another admin operation runs or the release state does not allow the move (e.g. enabling on a
colocated cluster, rolling back twice); 503 when a worker did not complete its role change in
time, or when the rollback's RECLAIM_UNPUBLISHED step found staging or an unpublished transfer
still held (the release stays ROLLING_BACK; posting the rollback again runs it from the top).
"""

from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from pdserve.api.errors import ApiError
from pdserve.api.openapi_doc import errors
from pdserve.router.process.release import IllegalReleaseTransition, ReleaseBusy, ReleaseController, RollbackIncomplete
from pdserve.router.process.role_control import RoleChangeFailed


class AdminBody(BaseModel):
    """An admin request body: strict types (a JSON boolean only, never "yes" or 1), no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)


class DisaggregationBody(AdminBody):
    enabled: bool


class RollbackBody(AdminBody):
    """The rollback takes no parameters: no body, or an empty JSON object."""


def check_admin_token(header: str, token: str) -> None:
    """Raise 401 unless `header` is `Bearer <token>` (edge/http_guard.py runs it before the body is read)."""
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin token>'",
                       type="authentication_error", code="invalid_admin_token")


async def _run(operation):
    try:
        return await operation
    except ReleaseBusy as exc:
        raise ApiError(409, str(exc), type="conflict_error", code="admin_busy") from None
    except (IllegalReleaseTransition, ValueError) as exc:
        raise ApiError(409, str(exc), type="conflict_error", code="illegal_release_transition") from None
    except RoleChangeFailed as exc:
        raise ApiError(503, str(exc), type="service_unavailable_error", code="role_change_failed") from None
    except RollbackIncomplete as exc:
        raise ApiError(503, str(exc), type="service_unavailable_error", code="rollback_incomplete") from None


def install_admin_routes(app: FastAPI, backend, token: str) -> None:
    """Mount /admin/* for a router-backed `backend` (module contract)."""
    if not token:
        raise ValueError("--admin-token must not be empty")
    if getattr(backend, "router", None) is None:
        raise ValueError("admin endpoints need a router-backed cluster (pdserve serve)")
    control = ReleaseController(backend)
    app.state.release = control

    def authorized(request: Request) -> None:
        check_admin_token(request.headers.get("authorization", ""), token)

    guard = [Depends(authorized)]  # again here (the app's HttpGuard checked it before the body was read)

    @app.get("/admin/state", tags=["admin"], dependencies=guard, responses=errors(401))
    async def admin_state() -> dict:
        return control.view()

    @app.post("/admin/disaggregation", tags=["admin"], dependencies=guard, responses=errors(400, 401, 409, 503))
    async def admin_disaggregation(body: DisaggregationBody) -> dict:
        return await _run(control.set_disaggregation(body.enabled))

    @app.post("/admin/rollback", tags=["admin"], dependencies=guard, responses=errors(400, 401, 409, 503))
    async def admin_rollback(request: Request, body: RollbackBody | None = None) -> dict:  # validated only to refuse a bad one
        if body is None and (await request.body()).strip():  # FastAPI reads a JSON null as no body
            raise ApiError(400, "/admin/rollback takes no body, or {}", param="body")
        return await _run(control.rollback())
