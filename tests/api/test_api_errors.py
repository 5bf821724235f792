"""Bad input gets a 4xx OpenAI error object with a clear message, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.conftest import MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.usefixtures("idle_engine_after")

GOOD = {"model": MODEL, "prompt": "ok", "max_tokens": 2, "ignore_eos": True}


def post(server, body, path="/v1/completions", **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        kwargs.setdefault("headers", {"content-type": "application/json"})
        return httpx.post(server.url + path, content=body, timeout=30, **kwargs)
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def assert_error(resp: httpx.Response, status: int, *fragments: str, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param
    return error


def assert_still_serving(server) -> None:
    resp = post(server, GOOD)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


BAD_COMPLETIONS = [
    pytest.param(b"{not json", "not valid JSON", None, id="malformed-json"),
    pytest.param(b"[1, 2]", "must be a JSON object", None, id="body-not-object"),
    pytest.param({**GOOD, "max_tokens": "5"}, "valid integer", "max_tokens", id="max-tokens-string"),
    pytest.param({**GOOD, "max_tokens": -3}, "greater than or equal to 0", "max_tokens", id="negative-max-tokens"),
    pytest.param({**GOOD, "max_tokens": 0}, "0 is allowed only with echo", "max_tokens", id="zero-max-tokens"),
    pytest.param({**GOOD, "temperature": "hot"}, "valid number", "temperature", id="temperature-string"),
    pytest.param({**GOOD, "temperature": -0.5}, "greater than or equal to 0", "temperature", id="negative-temperature"),
    pytest.param({**GOOD, "stream": "yes"}, "valid boolean", "stream", id="stream-string"),
    pytest.param({**GOOD, "top_p": 0}, "greater than 0", "top_p", id="top-p-zero"),
    pytest.param({**GOOD, "top_p": 1.5}, "less than or equal to 1", "top_p", id="top-p-above-one"),
    pytest.param({**GOOD, "n": 0}, "greater than or equal to 1", "n", id="n-0"),
    pytest.param({**GOOD, "n": 129}, "less than or equal to 128", "n", id="n-too-many"),
    pytest.param({**GOOD, "best_of": 3}, "best_of", "best_of", id="best-of"),
    pytest.param({**GOOD, "logprobs": 21}, "at most 20", "logprobs", id="logprobs-above-max"),
    pytest.param({**GOOD, "logprobs": -1}, "greater than or equal to 0", "logprobs", id="logprobs-negative"),
    pytest.param({**GOOD, "prompt_logprobs": 1, "stream": True}, "not available when `stream=True`",
                 "prompt_logprobs", id="prompt-logprobs-stream"),
    pytest.param({**GOOD, "prompt_logprobs": 1}, "use completions with echo", "prompt_logprobs", id="prompt-logprobs"),
    pytest.param({**GOOD, "presence_penalty": 0.5}, "presence_penalty", "presence_penalty", id="presence-penalty"),
    pytest.param({**GOOD, "frequency_penalty": 1}, "frequency_penalty", "frequency_penalty", id="frequency-penalty"),
    pytest.param({**GOOD, "logit_bias": {"5": 1}}, "logit_bias", "logit_bias", id="logit-bias"),
    pytest.param({**GOOD, "prompt": ["a", "b"]}, "one prompt per request", "prompt", id="several-prompts"),
    pytest.param({**GOOD, "prompt": []}, "prompt is empty", "prompt", id="empty-prompt"),
    pytest.param({**GOOD, "prompt": [1, -2]}, "list of token ids", "prompt", id="negative-token-id"),
    pytest.param({**GOOD, "prompt": {"a": 1}}, "must be a string", "prompt", id="prompt-object"),
    pytest.param({**GOOD, "prompt": [5] * MAX_MODEL_LEN}, "maximum context length", "prompt", id="ids-too-long"),
    pytest.param({**GOOD, "prompt": "x" * 500}, "maximum context length", "prompt", id="text-too-long"),
    pytest.param({**GOOD, "max_tokens": 10**9}, "maximum context length is 128", "max_tokens", id="huge-max-tokens"),
    pytest.param({**GOOD, "prompt": [5] * 100, "max_tokens": 29}, "100 prompt tokens + 29 completion tokens",
                 "max_tokens", id="max-tokens-one-past-the-context"),
    pytest.param({**GOOD, "prompt": [5] * 100, "max_tokens": 29, "n": 2}, "maximum context length", "max_tokens",
                 id="max-tokens-past-the-context-n2"),
    pytest.param({**GOOD, "stop": ""}, "stop strings must be non-empty", None, id="empty-stop"),
    pytest.param({**GOOD, "stop": [1]}, "valid string", None, id="stop-not-string"),
    pytest.param({**GOOD, "stream_options": {"include_usage": True}}, "only allowed when stream", "stream_options",
                 id="stream-options-without-stream"),
    pytest.param({**GOOD, "prompt": [100_000]}, "out of range", None, id="token-id-out-of-vocab"),
    pytest.param({**GOOD, "seed": 2**70}, "less than 9223372036854775808", "seed", id="seed-past-64-bits"),
    pytest.param({**GOOD, "top_k": 2**70}, "less than 2147483648", "top_k", id="top-k-past-32-bits"),
    pytest.param({"prompt": "x"}, "Field required", "model", id="missing-model"),
]


@pytest.mark.parametrize("body, fragment, param", BAD_COMPLETIONS)
def test_bad_completion_request_is_400(server, body, fragment, param):
    assert_error(post(server, body), 400, fragment, param=param)
    assert_still_serving(server)


BAD_CHATS = [
    pytest.param({"messages": []}, "at least 1 item", "messages", id="no-messages"),
    pytest.param({"messages": [{"role": "wizard", "content": "x"}]}, "Input should be", "messages.0.role",
                 id="bad-role"),
    pytest.param({"messages": "hi"}, "valid list", "messages", id="messages-string"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                 "only text content", "messages.0.content", id="image-part"),
    pytest.param({"messages": [{"role": "user", "content": "x" * 400}]}, "maximum context length", "messages",
                 id="too-long"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "tools",
                 id="tools"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
                 "at most 20", "top_logprobs", id="top-logprobs-above-max"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                 "`logprobs` must be set to true", "top_logprobs", id="top-logprobs-without-logprobs"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "echo": True, "stream": True, "prompt_logprobs": 1},
                 "not available when `stream=True`", "prompt_logprobs", id="echo-stream-prompt-logprobs"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**9},
                 "maximum context length is 128", "max_completion_tokens", id="huge-max-completion-tokens"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
                 "maximum context length is 128", "max_tokens", id="huge-max-tokens"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
                 "greater than or equal to 1", "max_completion_tokens", id="zero-max-completion-tokens"),
    pytest.param({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "greater than",
                 "max_completion_tokens", id="negative-max-completion-tokens"),
]


@pytest.mark.parametrize("body, fragment, param", BAD_CHATS)
def test_bad_chat_request_is_400(server, body, fragment, param):
    assert_error(post(server, {"model": MODEL, **body}, path="/v1/chat/completions"), 400, fragment, param=param)
    assert_still_serving(server)


def test_a_max_tokens_that_just_fits_beside_the_prompt_is_served(server):
    """prompt + max_tokens == max_model_len is the largest request vLLM serves; one more is the 400 above."""
    body = {**GOOD, "prompt": [5] * 100, "max_tokens": MAX_MODEL_LEN - 100}
    resp = post(server, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 100
    error = assert_error(post(server, {**body, "max_tokens": MAX_MODEL_LEN - 99}), 400, "at most 28", param="max_tokens")
    assert error["code"] == "context_length_exceeded"


def test_unknown_model_is_404(server):
    error = assert_error(post(server, {**GOOD, "model": "gpt-17"}), 404, "gpt-17", param="model")
    assert error["code"] == "model_not_found"
    assert_still_serving(server)


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, "Not Found")
    assert_error(httpx.get(server.url + "/v1/completions"), 405, "Method Not Allowed")


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="at most 20"):
        client.completions.create(model=MODEL, prompt="x", logprobs=21)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="x", top_p=0)
    out = client.completions.create(model=MODEL, prompt="still fine", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
