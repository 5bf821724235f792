"""Logprobs, echo and n > 1 over HTTP (the official openai client, the in-process backend):
OpenAI's shapes, values equal to transformers' raw log_softmax, and nothing held afterwards."""

from __future__ import annotations

import httpx
import pytest
import torch

from pdserve.engine.sequence import SamplingParams
from tests.api.conftest import MODEL, wait_idle
from tests.helpers.checkpoints import load_hf_model

TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir)


def hf_log_probs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [S, V]


def name(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def test_completion_logprobs_equal_transformers(client, backend, tokenizer, hf):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    ids = tokenizer.encode(PROMPT)
    ref = hf_log_probs(hf, ids + choice.token_ids)[len(ids) - 1 : -1]
    lp = choice.logprobs
    assert lp.tokens == [name(tokenizer, t) for t in choice.token_ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for i, t in enumerate(choice.token_ids):
        assert abs(lp.token_logprobs[i] - ref[i, t].item()) <= TOL
        top = torch.topk(ref[i], 3)
        expected = {name(tokenizer, j): v for j, v in zip(top.indices.tolist(), top.values.tolist())}
        assert set(lp.top_logprobs[i]) == set(expected) | {lp.tokens[i]}
        assert all(abs(lp.top_logprobs[i][k] - v) <= TOL for k, v in expected.items())
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True}))
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert max(abs(v - w) for v, w in zip((v for p in parts for v in p.token_logprobs), lp.token_logprobs)) <= TOL
    assert [o for p in parts for o in p.text_offset] == lp.text_offset  # offsets continue across chunks
    wait_idle(backend)


def test_echo_returns_prompt_logprobs_and_a_repeat_recomputes_them(client, backend, tokenizer, hf):
    ids = tokenizer.encode(PROMPT)
    ref = hf_log_probs(hf, ids)
    bodies = []
    for _ in range(2):  # the second request finds the prompt's blocks cached and must still score them
        bodies.append(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1))
    first, second = bodies
    choice = first.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert first.usage.completion_tokens == 0 and first.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [name(tokenizer, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) <= TOL
    assert second.choices[0].logprobs == lp
    # lm-eval's loglikelihood request: echo, one generated token, logprobs 1
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0.0)
    lp1 = one.choices[0].logprobs
    assert lp1.token_logprobs[: len(ids)] == lp.token_logprobs and len(lp1.tokens) == len(ids) + 1
    assert one.choices[0].text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    wait_idle(backend)


def test_streamed_echo_leads_with_the_prompt(client, backend, tokenizer):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0,
                                            stream=True, temperature=0.0, extra_body={"ignore_eos": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert pieces[0].text.startswith(PROMPT) and pieces[0].logprobs.token_logprobs[0] is None
    n_prompt = len(tokenizer.encode(PROMPT))
    assert sum(len(p.logprobs.tokens) for p in pieces if p.logprobs) == n_prompt + 3
    wait_idle(backend)


def test_chat_logprobs_shape_and_values(client, backend, reference_engine, tokenizer, server):
    messages = [{"role": "user", "content": "Say something about foxes."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    content = out.choices[0].logprobs.content
    ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2))[0]
    assert [c.token for c in content] == [name(tokenizer, t) for t in ref.output_ids]
    assert all(c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2 for c in content)
    assert content[-1].logprob == ref.logprobs[0].logprob  # the last step's entry, bitwise as the engine's
    assert [t.logprob for t in content[-1].top_logprobs] == list(ref.logprobs[0].top_logprobs)
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.0,
                                                   logprobs=True, top_logprobs=2, stream=True,
                                                   extra_body={"ignore_eos": True}))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [c.token for c in content]
    # the repeat hits the prefix cache: the uncached tail is computed in another chunk shape
    assert max(abs(e.logprob - c.logprob) for e, c in zip(entries, content)) <= TOL
    wait_idle(backend)


def test_chat_echo_follows_vllm(client, backend):
    messages = [{"role": "user", "content": "Finish this:"}, {"role": "assistant", "content": "Once upon"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0.0,
                                         extra_body={"echo": True, "add_generation_prompt": False, "ignore_eos": True})
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0.0,
                                           extra_body={"add_generation_prompt": False, "ignore_eos": True})
    assert out.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    # with a generation prompt the answer's role (assistant) is not the last message's: nothing is echoed
    user_last = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=3, temperature=0.0,
                                               extra_body={"echo": True, "ignore_eos": True})
    assert not user_last.choices[0].message.content.startswith("Finish this:")
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0.0,
                                                   stream=True, extra_body={"echo": True, "add_generation_prompt": False,
                                                                            "ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content
    wait_idle(backend)


def test_n_choices_are_reproducible_and_streamed_by_index(client, backend):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234, n=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) == 3
    assert a.usage.completion_tokens == 18
    single = client.completions.create(**{**kw, "n": 1})
    assert single.choices[0].token_ids == a.choices[0].token_ids  # choice 0 keeps the request's seed
    chunks = list(client.completions.create(**kw, stream=True))
    for choice in a.choices:
        mine = [ch for c in chunks for ch in c.choices if ch.index == choice.index]
        assert [t for ch in mine for t in (ch.token_ids or [])] == choice.token_ids
        assert "".join(ch.text for ch in mine) == choice.text
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["length"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
                                          seed=7, logprobs=True, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and all(len(c.logprobs.content) == 4 for c in chat.choices)
    wait_idle(backend)


def test_max_logprobs_flag_caps_requests_and_a_refusal_holds_nothing(backend):
    from pdserve.api.app import create_app
    from pdserve.cli import build_parser
    from pdserve.commands.serve import serve_config
    from tests.api.servers import ServerThread

    assert serve_config(build_parser().parse_args(["serve", "--max-logprobs", "3"])).max_logprobs == 3
    assert serve_config(build_parser().parse_args(["serve"])).max_logprobs == 20
    srv = ServerThread(create_app(backend, max_logprobs=3)).start()
    try:
        url = f"{srv.url}/v1"
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 2, "ignore_eos": True}
        ok = httpx.post(f"{url}/completions", json={**body, "logprobs": 3})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 3
        refused = [
            httpx.post(f"{url}/completions", json={**body, "logprobs": 4}),
            httpx.post(f"{url}/completions", json={**body, "echo": True, "logprobs": 4, "stream": True}),
            httpx.post(f"{url}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                        "logprobs": True, "top_logprobs": 4}),
        ]
        for resp in refused:
            assert resp.status_code == 400 and "at most 3" in resp.json()["error"]["message"]
            assert resp.json()["error"]["param"] in ("logprobs", "top_logprobs")
        wait_idle(backend)  # nothing was admitted, nothing is held
        assert httpx.post(f"{url}/completions", json=body).json()["usage"]["completion_tokens"] == 2
    finally:
        srv.stop()
