"""The HTTP edge's guard (api/edge/http_guard.py) over the scripted backend, and where `pdserve serve`
reads the admin token from (commands/serve.py): a file or the environment, argv only deprecated."""

from __future__ import annotations

import argparse

import httpx
import pytest

from pdserve.api.app import create_app
from pdserve.commands.serve import ADMIN_TOKEN_ENV, admin_token
from tests.api.servers import FakeBackend, ServerThread, finish, tokens

LIMIT = 4096


@pytest.fixture(scope="module")
def server():
    backend = FakeBackend(events=[*tokens("A", "B"), finish(completion_tokens=2)])
    thread = ServerThread(create_app(backend, api_keys={"k1": "t1"}, max_request_body_bytes=LIMIT)).start()
    yield thread
    thread.stop()


def body_of(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (padded with JSON whitespace)."""
    core = b'{"model": "fake", "prompt": "hi", "max_tokens": 2}'
    return core[:-1] + b" " * (size - len(core)) + b"}"


def test_a_body_at_the_limit_is_served_and_one_byte_more_is_413(server):
    auth = {"Authorization": "Bearer k1", "Content-Type": "application/json"}
    at = httpx.post(f"{server.url}/v1/completions", content=body_of(LIMIT), headers=auth, timeout=10)
    over = httpx.post(f"{server.url}/v1/completions", content=body_of(LIMIT + 1), headers=auth, timeout=10)
    chunked = httpx.post(f"{server.url}/v1/completions", content=iter([body_of(LIMIT + 1)[:2000], body_of(LIMIT + 1)[2000:]]),
                         headers=auth, timeout=10)  # no Content-Length: counted as it streams in
    assert at.status_code == 200 and at.json()["usage"]["completion_tokens"] == 2
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
    assert chunked.status_code == 413
    again = httpx.post(f"{server.url}/v1/completions", content=body_of(100), headers=auth, timeout=10)
    assert again.status_code == 200


def test_a_keyed_route_checks_the_key_before_the_body(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers=headers, timeout=10)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # unguarded routes stay open


def test_with_api_keys_every_v1_route_and_the_tokenizer_routes_need_a_key(server):
    """vLLM's --api-key guards every /v1 route; /tokenize and /detokenize run the model's tokenizer
    and template on the body, so they are keyed too (they were open). Operator routes stay open."""
    keyed = [("POST", "/tokenize", {"model": "fake", "prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104, 105]}),
             ("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": "fake", "prompt": "hi"})]
    for method, path, body in keyed:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=10)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", (path, answer.text)
    auth = {"Authorization": "Bearer k1"}
    counted = httpx.post(f"{server.url}/tokenize", json={"model": "fake", "prompt": "hi"}, headers=auth, timeout=10)
    assert counted.status_code == 200 and counted.json()["tokens"] == [104, 105]
    assert httpx.get(f"{server.url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"] == "fake"
    for path in ("/health", "/metrics", "/workers"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200, path


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"admin_token_file": None, "admin_token": None, **kw})


def test_the_admin_token_comes_from_a_file_or_the_environment(tmp_path, capsys):
    path = tmp_path / "admin.token"
    path.write_text("from-file\n")
    assert admin_token(args(admin_token_file=str(path)), {}) == "from-file"
    assert admin_token(args(), {ADMIN_TOKEN_ENV: "from-env"}) == "from-env"
    assert admin_token(args(), {}) is None
    assert capsys.readouterr().err == ""
    assert admin_token(args(admin_token="from-argv"), {}) == "from-argv"  # deprecated, with a warning
    assert "visible in `ps`" in capsys.readouterr().err
    with pytest.raises(ValueError, match="once"):
        admin_token(args(admin_token_file=str(path)), {ADMIN_TOKEN_ENV: "x"})
    path.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        admin_token(args(admin_token_file=str(path)), {})
