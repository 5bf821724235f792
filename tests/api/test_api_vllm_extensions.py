"""vLLM's sampling extensions over HTTP (one tiny engine): min_tokens, stop_token_ids and
repetition_penalty change the output exactly as vLLM's do, and every other vLLM extension set to a
non-default value is a 400 naming it, never silently dropped (api/extensions.py)."""

from __future__ import annotations

import httpx
import pytest

from pdserve.api.protocol import SCRIPTED_EOS_HEADER
from pdserve.engine.sequence import SamplingParams
from tests.api.conftest import MODEL, wait_idle

PROMPT = [5, 17, 99, 3, 42, 8, 8, 120, 61, 7]
BASE = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}
REFUSED_VALUES = {  # one non-default value for each refused extension
    "min_p": 0.1, "length_penalty": 0.5, "use_beam_search": True, "allowed_token_ids": [1, 2], "bad_words": ["x"],
    "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4, "priority": 1, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'", "structured_outputs": {"regex": "a"},
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "add_special_tokens": False,
}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(http, body, route="/v1/completions", **kw) -> dict:
    answer = http.post(route, json=body, **kw)
    assert answer.status_code == 200, answer.text
    return answer.json()


def first_new(tokens: list[int], start: int) -> int:
    """The first position at or after `start` whose token did not occur before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_token_ids_end_at_the_first_occurrence_without_its_text(http, backend, tokenizer):
    base = post(http, {**BASE, "repetition_penalty": 1.5})["choices"][0]["token_ids"]  # varied tokens
    k = first_new(base, 2)
    out = post(http, {**BASE, "repetition_penalty": 1.5, "stop_token_ids": [base[k]]})["choices"][0]
    assert out["token_ids"] == base[: k + 1] and out["finish_reason"] == "stop"
    assert out["text"] == tokenizer.decode(base[:k])  # like EOS: the stop id's text is not in the output
    wait_idle(backend)


def test_min_tokens_suppresses_stop_ids_exactly(http, backend):
    """Before min_tokens outputs a stop id is never sampled: where greedy took it, the runner-up
    of the raw logits (its top-2 logprobs) comes instead."""
    base = post(http, {**BASE, "repetition_penalty": 1.5, "logprobs": 2})["choices"][0]
    ids, top = base["token_ids"], base["logprobs"]["top_logprobs"]
    k = first_new(ids, 1)
    out = post(http, {**BASE, "repetition_penalty": 1.5, "stop_token_ids": [ids[k]], "min_tokens": k + 2})
    got = out["choices"][0]["token_ids"]
    assert got[:k] == ids[:k] and got[k] != ids[k] and len(got) >= k + 2
    assert ids[k] not in got[: k + 2]
    if len(top[k]) == 2:  # two texts (byte tokens may share one): the other is the runner-up
        (runner_up,) = [text for text in top[k] if text != tokenizer_text(http, ids[k])]
        assert tokenizer_text(http, got[k]) == runner_up
    wait_idle(backend)


def tokenizer_text(http, token: int) -> str:
    return http.post("/detokenize", json={"model": MODEL, "tokens": [token]}).json()["prompt"]


def test_min_tokens_holds_off_the_scripted_eos(http, backend):
    body = {**BASE, "ignore_eos": False, "min_tokens": 6}
    out = post(http, body, headers={SCRIPTED_EOS_HEADER: "3"})
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (6, "stop")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
            "min_tokens": 5}
    out = post(http, chat, "/v1/chat/completions", headers={SCRIPTED_EOS_HEADER: "2"})
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (5, "stop")
    wait_idle(backend)


def test_repetition_penalty_reaches_the_engine(http, backend, reference_engine):
    """The penalty's arithmetic is checked against a plain loop in tests/engine/test_logits_processors.py."""
    plain = post(http, BASE)["choices"][0]["token_ids"]
    penalized = post(http, {**BASE, "repetition_penalty": 1.5})["choices"][0]["token_ids"]
    want = reference_engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.5))
    assert penalized == list(want[0].output_ids) and penalized != plain
    assert post(http, {**BASE, "repetition_penalty": 1.0})["choices"][0]["token_ids"] == plain
    wait_idle(backend)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_extensions_are_400s_naming_them(http, route, field):
    body = dict(BASE) if route == "/v1/completions" else {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    value = True if field == "add_special_tokens" and route != "/v1/completions" else REFUSED_VALUES[field]
    answer = http.post(route, json={**body, field: value})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported_parameter") and field in error["message"]


def test_extension_values_are_checked(http):
    for extra, param in [({"min_tokens": 13}, "min_tokens"), ({"max_tokens": None, "min_tokens": 17}, "min_tokens"),
                         ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
                         ({"stop_token_ids": [1 << 20]}, None)]:
        answer = http.post("/v1/completions", json={**BASE, **extra})
        assert answer.status_code == 400, (extra, answer.text)
        assert param is None or answer.json()["error"]["param"] == param, answer.text
    neutral = {"min_p": 0, "use_beam_search": False, "skip_special_tokens": True, "add_special_tokens": True,
               "bad_words": [], "priority": 0, "min_tokens": 0, "stop_token_ids": []}
    assert http.post("/v1/completions", json={**BASE, **neutral}).status_code == 200
