"""The admin endpoints' bodies (api/admin.py) over a stand-in router: a body of the wrong shape or
type is refused with 400 and reaches no admin operation; an unauthenticated call is refused with
401 before its body is read."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from pdserve.api.app import create_app
from tests.api.servers import FakeBackend, ServerThread

TOKEN = "s3cret-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def stand_in_router() -> SimpleNamespace:
    """What the release controller reads of a router (router/process/release.py)."""
    return SimpleNamespace(disaggregation=True, handoff_enabled=True, route_epoch=1,
                           config=SimpleNamespace(heartbeat_timeout_s=10.0))


@pytest.fixture(scope="module")
def admin():
    """A served app with /admin mounted; each admin operation is replaced by a recorder."""
    backend = FakeBackend()
    backend.router = stand_in_router()
    app = create_app(backend, admin_token=TOKEN)
    calls: list[tuple] = []
    release = app.state.release

    async def set_disaggregation(enabled):
        calls.append(("disaggregation", enabled))
        return {"state": release.state, "role_changes": []}

    async def rollback():
        calls.append(("rollback",))
        return {"state": release.state, "steps": []}

    release.set_disaggregation, release.rollback = set_disaggregation, rollback
    server = ServerThread(app).start()
    yield SimpleNamespace(url=server.url, calls=calls)
    server.stop()


def post(admin, path: str, content: bytes | None, headers: dict | None = None) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{admin.url}{path}", content=content, headers=headers, timeout=10)


@pytest.mark.parametrize("body", [b'{"enabled": "yes"}', b'{"enabled": "true"}', b'{"enabled": 1}',
                                  b'{"enabled": null}', b'{"enabled": "false"}', b"{}", b'{"enabled": true, "x": 1}',
                                  b"[true]", b"{not json"])
def test_disaggregation_takes_a_json_boolean_only(admin, body):
    """{"enabled": "yes"} used to switch disaggregation on (pydantic's lax bool)."""
    admin.calls.clear()
    answer = post(admin, "/admin/disaggregation", body)
    assert answer.status_code == 400, answer.text
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert admin.calls == []


@pytest.mark.parametrize("body, content_type", [(b"{not json", "application/json"), (b'{"force": true}', "application/json"),
                                                (b"[1, 2]", "application/json"), (b'"now"', "application/json"),
                                                (b"null", "application/json"), (b" null ", "application/json"),
                                                (b"garbage", "text/plain")])
def test_rollback_refuses_a_body_it_does_not_take(admin, body, content_type):
    """The rollback used to run whatever body came with it."""
    admin.calls.clear()
    answer = post(admin, "/admin/rollback", body, {"Content-Type": content_type})
    assert answer.status_code == 400, answer.text
    assert admin.calls == []


def test_well_formed_admin_calls_reach_their_operation(admin):
    admin.calls.clear()
    assert post(admin, "/admin/disaggregation", b'{"enabled": false}').status_code == 200
    assert post(admin, "/admin/rollback", None).status_code == 200
    assert post(admin, "/admin/rollback", b"{}").status_code == 200
    assert admin.calls == [("disaggregation", False), ("rollback",), ("rollback",)]


def test_an_unauthenticated_admin_call_is_401_before_its_body_is_read(admin):
    admin.calls.clear()
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer nope"}):
        for path in ("/admin/rollback", "/admin/disaggregation"):
            answer = post(admin, path, b"{not json", headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_admin_token"
    assert admin.calls == []
