"""Routes and response shapes: health, models, metrics, workers, rejections, backend errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve.api.backend import Rejection
from tests.api.conftest import MODEL
from tests.api.servers import error, finish, tokens

FAKE = {"model": "fake", "prompt": "hi"}


def sse_payloads(text: str) -> list:
    """Data payloads of an SSE body, "[DONE]" kept as a string."""
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[6:] if f[6:] == "[DONE]" else json.loads(f[6:]) for f in frames]


# ---- real backend -------------------------------------------------------------------------
def test_health_models_metrics_workers(server, client):
    client.completions.create(model=MODEL, prompt="warm", max_tokens=2, extra_body={"ignore_eos": True})
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'pdserve_requests_total{result="length"}' in metrics.text
    assert "pdserve_time_to_first_token_seconds_count" in metrics.text
    assert "pdserve_time_per_output_token_seconds_count" in metrics.text
    workers = httpx.get(server.url + "/workers").json()
    assert len(workers) == 1 and workers[0]["role"] == "colocated" and workers[0]["state"] == "serving"
    assert set(workers[0]) == {"id", "role", "host", "pid", "epoch", "state", "load", "cpu", "tp"}
    assert workers[0]["tp"] == 1  # tensor-parallel ranks (workers/process/tp_rank.py)
    cpu = workers[0]["cpu"]
    assert cpu["kind"] in ("avx2", "avx512", "avx512-bf16", "avx512-amx", "other") and set(cpu["features"]) == {
        "avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert cpu["products"] and cpu["compute_dtype"] in ("float32", "bfloat16")


# ---- scripted backend ---------------------------------------------------------------------
def test_unhealthy_backend_is_503(fake_server, fake):
    fake.is_healthy = False
    resp = httpx.get(fake_server.url + "/health")
    assert resp.status_code == 503 and resp.json() == {"status": "unhealthy"}


def test_fake_routes(fake_server):
    assert httpx.get(fake_server.url + "/metrics").text.endswith("fake_up 1.0\n")
    assert httpx.get(fake_server.url + "/workers").json()[0]["epoch"] == 3


@pytest.mark.parametrize("status, kind", [(429, "rate_limit_error"), (503, "service_unavailable_error")])
@pytest.mark.parametrize("stream", [False, True])
def test_rejection_has_retry_after(fake_server, fake, status, kind, stream):
    fake.reject = Rejection("too busy", status=status, retry_after_s=2.6, reason="queue_full")
    resp = httpx.post(fake_server.url + "/v1/completions", json={**FAKE, "stream": stream})
    assert resp.status_code == status
    assert resp.headers["retry-after"] == "3"
    assert resp.json()["error"] == {"message": "too busy", "type": kind, "param": None, "code": "queue_full"}
    assert fake.aborts == []


def test_completion_stream_shape(fake_server, fake):
    fake.events = [*tokens("he", "llo"), finish("stop", 2, 3, text="!")]
    body = {**FAKE, "stream": True, "stream_options": {"include_usage": True}}
    payloads = sse_payloads(httpx.post(fake_server.url + "/v1/completions", json=body).text)
    *chunks, usage, done = payloads
    assert done == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks] == ["he", "llo", "!"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") and c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert fake.aborts == []


def test_chat_stream_shape_with_token_ids(fake_server, fake):
    fake.events = [*tokens("a", "", "b"), finish("length", 4, 3)]
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True, "return_token_ids": True}
    *chunks, done = sse_payloads(httpx.post(fake_server.url + "/v1/chat/completions", json=body).text)
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:]]
    assert "".join(deltas) == "ab"
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == [0, 1, 2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_non_streamed_aggregates_text_and_usage(fake_server, fake):
    fake.events = [*tokens("x", "y"), finish("stop", 5, 2, text="z")]
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "return_token_ids": True}
    out = httpx.post(fake_server.url + "/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "xyz"}
    assert out["choices"][0]["token_ids"] == [0, 1] and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_error_mid_stream_becomes_error_event_then_done(fake_server, fake):
    fake.events = [*tokens("a"), error("the decode worker died", "worker_lost")]
    payloads = sse_payloads(httpx.post(fake_server.url + "/v1/completions", json={**FAKE, "stream": True}).text)
    assert payloads[0]["choices"][0]["text"] == "a"
    assert payloads[1] == {"error": {"message": "the decode worker died", "type": "server_error", "param": None,
                                     "code": "worker_lost"}}
    assert payloads[2:] == ["[DONE]"]
    assert fake.aborts == []


def test_error_mid_stream_raises_in_openai_client(fake_server, fake):
    fake.events = [*tokens("a"), error("kv lost", "kv_not_visible")]
    client = openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="kv lost"):
        list(client.completions.create(model="fake", prompt="x", stream=True))


@pytest.mark.parametrize("stream", [False, True])
def test_error_before_output_is_an_http_error(fake_server, fake, stream):
    fake.events = [error("no route", "worker_lost")]
    resp = httpx.post(fake_server.url + "/v1/completions", json={**FAKE, "stream": stream})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "worker_lost"


def test_error_after_output_in_non_streamed_request(fake_server, fake):
    fake.events = [*tokens("a"), error("boom", "internal_error")]
    resp = httpx.post(fake_server.url + "/v1/completions", json=FAKE)
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "boom"


def test_backend_exception_mid_stream_becomes_error_event(fake_server, fake):
    fake.events = tokens("a")
    fake.raise_after = KeyError("lost")
    payloads = sse_payloads(httpx.post(fake_server.url + "/v1/completions", json={**FAKE, "stream": True}).text)
    assert payloads[1]["error"]["code"] == "internal_error" and "KeyError" in payloads[1]["error"]["message"]
    assert payloads[2:] == ["[DONE]"]
    assert fake.aborts == fake.submitted  # the backend never reported an end: abort it
