"""The official openai client against the real app over an in-process tiny engine."""

from __future__ import annotations

import pytest

from pdserve.api.chat_template import render_chat
from pdserve.engine.sequence import SamplingParams
from tests.api.conftest import MODEL

pytestmark = pytest.mark.usefixtures("idle_engine_after")

EXTRA = {"ignore_eos": True, "return_token_ids": True}


def reference(engine, prompt_ids: list[int], **params):
    return engine.generate([prompt_ids], SamplingParams(ignore_eos=True, **params))[0]


def stream_completion(client, **kwargs):
    """-> (text, token ids, finish_reason, usage or None) from a streamed completion."""
    text, ids, finish, usage = [], [], None, None
    for chunk in client.completions.create(model=MODEL, stream=True, extra_body=EXTRA, **kwargs):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.text)
            ids.extend(choice.token_ids)
            finish = choice.finish_reason or finish
    return "".join(text), ids, finish, usage


def stream_chat(client, **kwargs):
    text, ids, finish, roles = [], [], None, []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, extra_body=EXTRA, **kwargs):
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            text.append(choice.delta.content or "")
            ids.extend(choice.token_ids)
            finish = choice.finish_reason or finish
    return "".join(text), ids, finish, roles


def test_completion_matches_engine_greedy(client, tokenizer, reference_engine):
    prompt = "Hello, pdserve!"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=EXTRA)
    ids = tokenizer.encode(prompt)
    ref = reference(reference_engine, ids, max_tokens=12, temperature=0.0)
    choice = out.choices[0]
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert choice.token_ids == list(ref.output_ids)
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 12, len(ids) + 12)


def test_completion_matches_engine_sampled_token_ids(client, reference_engine):
    prompt_ids = [257, 10, 20, 30, 40, 50]
    params = dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=1234)
    out = client.completions.create(model=MODEL, prompt=prompt_ids, extra_body={**EXTRA, "top_k": 50}, **params)
    ref = reference(reference_engine, prompt_ids, top_k=50, **params)
    assert out.choices[0].token_ids == list(ref.output_ids)
    assert out.usage.prompt_tokens == len(prompt_ids)


def test_streamed_completion_equals_non_streamed(client, tokenizer):
    kwargs = dict(prompt="Streams and bodies agree.", max_tokens=20, seed=99, temperature=1.0)
    whole = client.completions.create(model=MODEL, extra_body=EXTRA, **kwargs)
    text, ids, finish, usage = stream_completion(client, stream_options={"include_usage": True}, **kwargs)
    assert text == whole.choices[0].text
    assert ids == whole.choices[0].token_ids and len(ids) == 20
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage.prompt_tokens == len(tokenizer.encode(kwargs["prompt"])) and usage.completion_tokens == 20


def test_stream_without_usage_option_sends_no_usage_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=3, stream=True, extra_body=EXTRA))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_matches_engine_and_stream(client, tokenizer, reference_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kwargs = dict(messages=messages, max_tokens=10, temperature=0.7, seed=5)
    whole = client.chat.completions.create(model=MODEL, extra_body=EXTRA, **kwargs)
    prompt_ids = tokenizer.encode(render_chat([(m["role"], m["content"]) for m in messages]))
    ref = reference(reference_engine, prompt_ids, max_tokens=10, temperature=0.7, seed=5)
    choice = whole.choices[0]
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.token_ids == list(ref.output_ids)
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 10
    text, ids, finish, roles = stream_chat(client, **kwargs)
    assert (text, ids, finish) == (choice.message.content, choice.token_ids, choice.finish_reason)
    assert roles[0] == "assistant" and all(r is None for r in roles[1:])


def test_chat_max_completion_tokens_and_content_parts(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4, extra_body=EXTRA)
    assert out.usage.completion_tokens == 4


def _seed_with_ascii_stop(client, prompt: str) -> tuple[int, str, str]:
    """A seed whose output text has two printable ASCII chars after its start -> (seed, text, stop)."""
    for seed in range(40):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, seed=seed, extra_body=EXTRA)
        text = out.choices[0].text
        for i in range(1, len(text) - 1):
            stop = text[i : i + 2]
            if stop.isascii() and stop.isprintable() and text.find(stop) == i:
                return seed, text, stop
    pytest.skip("no seed produced printable text")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(client, stream):
    prompt = "Stop here:"
    seed, full, stop = _seed_with_ascii_stop(client, prompt)
    kwargs = dict(prompt=prompt, max_tokens=24, seed=seed, stop=[stop, "\x00never"])
    if stream:
        text, ids, finish, _ = stream_completion(client, **kwargs)
    else:
        out = client.completions.create(model=MODEL, extra_body=EXTRA, **kwargs)
        text, ids, finish = out.choices[0].text, out.choices[0].token_ids, out.choices[0].finish_reason
    assert text == full[: full.index(stop)]
    assert finish == "stop"
    assert 0 < len(ids) < 24


def test_models_route(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
