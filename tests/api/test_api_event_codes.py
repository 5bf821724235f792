"""Errors that end a request before its response started get the status their cause deserves:
a client's fault 400, a short cluster 503, only the unexpected 500 (api/errors.py)."""

from __future__ import annotations

import pytest

from pdserve.api.errors import from_event_code


@pytest.mark.parametrize("code, status, kind", [
    ("invalid_request", 400, "invalid_request_error"), ("kv_not_visible", 503, "server_error"),
    ("worker_lost", 503, "server_error"), ("shutdown", 503, "server_error"), ("engine_error", 500, "server_error")])
def test_event_codes_map_to_their_status(code, status, kind):
    error = from_event_code("message", code)
    assert (error.info.status, error.info.type, error.info.code) == (status, kind, code)
