"""Chat through the checkpoint's own template (ids equal transformers' apply_chat_template), the
fallback when a checkpoint has none, /tokenize and /detokenize over HTTP, and the 400 cases
(template errors, unknown template variables, ids outside the vocabulary) after which the
server keeps serving and the engine holds nothing."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from pdserve.api.app import create_app
from pdserve.api.chat_template import render_chat
from pdserve.api.inproc import InProcessBackend
from pdserve.engine.engine import Engine
from tests.api.conftest import MAX_MODEL_LEN, MODEL, engine_config, wait_idle
from tests.api.servers import ServerThread
from tests.helpers.checkpoints import CHATML_TEMPLATE, make_random_checkpoint, write_chat_tokenizer

VOCAB = 272
TEMPLATED = "templated-test"
# ChatML plus two ways to fail: tool messages raise, developer messages read a variable only
# chat_template_kwargs can supply
SERVER_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{% if message['role'] == 'developer' %}{{ developer_preamble }}{% endif %}"
    "{% endfor %}" + CHATML_TEMPLATE
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|> there"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def templated_dir(tmp_path_factory):
    model_dir = make_random_checkpoint(tmp_path_factory.mktemp("templated"), hidden=64, layers=1, vocab=VOCAB,
                                       max_pos=MAX_MODEL_LEN, with_tokenizer=True, seed=3)
    return write_chat_tokenizer(model_dir, VOCAB, SERVER_TEMPLATE)


@pytest.fixture(scope="module")
def templated(templated_dir):
    """(backend, base url) of a server over the checkpoint with a chat template."""
    torch.set_num_threads(1)
    backend = InProcessBackend(Engine(engine_config(templated_dir)), TEMPLATED)
    srv = ServerThread(create_app(backend)).start()
    yield backend, srv.url
    srv.stop()
    backend.close()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def assert_error(resp: httpx.Response, status: int, param: str, fragment: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert fragment in error["message"], error


# ---- the checkpoint's template ------------------------------------------------------------
def test_chat_prefills_the_ids_transformers_renders(templated, templated_dir):
    backend, url = templated
    hf_ids = list(AutoTokenizer.from_pretrained(templated_dir).apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False))
    counted = post(url, "/tokenize", {"model": TEMPLATED, "messages": MESSAGES}).json()
    assert counted == {"count": len(hf_ids), "max_model_len": MAX_MODEL_LEN, "tokens": hf_ids}
    chat = post(url, "/v1/chat/completions", {"model": TEMPLATED, "messages": MESSAGES, **GREEDY}).json()
    by_ids = post(url, "/v1/completions", {"model": TEMPLATED, "prompt": hf_ids, **GREEDY}).json()
    assert chat["usage"]["prompt_tokens"] == len(hf_ids)
    assert chat["choices"][0]["token_ids"] == by_ids["choices"][0]["token_ids"]  # greedy from the same prompt
    with_bos = post(url, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True}).json()["tokens"]
    assert with_bos == [backend.tokenizer().bos_token_id, *hf_ids]
    no_prompt = post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert no_prompt == list(AutoTokenizer.from_pretrained(templated_dir).apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=False, return_dict=False))
    wait_idle(backend)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_template_errors_are_400_and_the_server_keeps_serving(templated, path):
    backend, url = templated
    tool = [{"role": "user", "content": "x"}, {"role": "tool", "content": "result"}]
    assert_error(post(url, path, {"model": TEMPLATED, "messages": tool, **GREEDY}), 400, "messages",
                 "tool messages are not supported")
    developer = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "x"}]
    assert_error(post(url, path, {"model": TEMPLATED, "messages": developer, **GREEDY}), 400, "messages",
                 "'developer_preamble' is undefined")
    kwargs = {"chat_template_kwargs": {"developer_preamble": "P"}}
    ok = post(url, path, {"model": TEMPLATED, "messages": developer, **GREEDY, **kwargs})
    assert ok.status_code == 200, ok.text
    wait_idle(backend)


# ---- the fallback (the session's tiny model has no template) ------------------------------
def test_fallback_when_the_checkpoint_has_none(server, client, tokenizer, backend):
    assert tokenizer.chat_template is None
    messages = MESSAGES[:2]
    fallback_ids = tokenizer.encode(render_chat([(m["role"], m["content"]) for m in messages]))
    counted = post(server.url, "/tokenize", {"model": MODEL, "messages": messages}).json()
    assert counted["tokens"] == fallback_ids and counted["count"] == len(fallback_ids)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert out.usage.prompt_tokens == len(fallback_ids)
    open_ended = post(server.url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert open_ended["tokens"] == tokenizer.encode(render_chat([(m["role"], m["content"]) for m in messages], False))
    wait_idle(backend)


# ---- tokenize / detokenize ----------------------------------------------------------------
@pytest.mark.parametrize("text", ["hello", "héllo wörld ✓ </s> <|im_start|>", " spaces  and\nlines "])
def test_tokenize_detokenize_round_trip(server, tokenizer, text):
    plain = post(server.url, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_bos=False) and plain["count"] == len(plain["tokens"])
    assert post(server.url, "/detokenize", {"model": MODEL, "tokens": plain["tokens"]}).json() == {"prompt": text}
    with_bos = post(server.url, "/tokenize", {"prompt": text}).json()  # as /v1/completions encodes it
    assert with_bos["tokens"] == tokenizer.encode(text) and with_bos["max_model_len"] == MAX_MODEL_LEN
    assert post(server.url, "/detokenize", {"tokens": with_bos["tokens"]}).json() == {"prompt": "<s>" + text}


def test_templated_round_trip_keeps_control_tokens(templated):
    _, url = templated
    ids = post(url, "/tokenize", {"messages": MESSAGES[:1]}).json()["tokens"]
    text = post(url, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("body, status, param, fragment", [
    ({"tokens": [1, 2, 259]}, 400, "tokens", "token id 259 is outside the vocabulary (0..258)"),
    ({"tokens": [-1]}, 400, "tokens", "token id -1 is outside"),
    ({"tokens": ["a"]}, 400, "tokens.0", "tokens.0"),
    ({"model": "other", "tokens": [1]}, 404, "model", "does not exist"),
])
def test_detokenize_bad_input(server, client, body, status, param, fragment):
    assert_error(post(server.url, "/detokenize", body), status, param, fragment)
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=1).choices[0].text is not None


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "exactly one of prompt and messages"),
    ({}, "prompt", "exactly one of prompt and messages"),
    ({"messages": []}, "messages", "messages is empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content", "only text"),
    ({"prompt": 5}, "prompt", "prompt"),
])
def test_tokenize_bad_input(server, body, param, fragment):
    assert_error(post(server.url, "/tokenize", body), 400, param, fragment)
