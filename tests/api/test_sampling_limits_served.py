"""Sampling values at the edges of fp32, and a request's stop strings, through `pdserve serve`
with its defaults (1P1D, the tiny model).

Found by an adversarial pass: `temperature` 1e-300 and `top_p` 1e-300 are finite numbers the API
accepts, but in fp32 they are 0, so the logits were divided by zero (NaN probabilities) or every
token was dropped, and each step sampled token 0. vLLM treats a temperature below 1e-5 as greedy
and top-p always keeps the most likely token; so does pdserve now. A repetition penalty outside
fp32's range was 0 or inf in the logits and is refused, as is a temperature above fp32's largest
number (inf there: with min_tokens, -inf / inf gave NaN and token 0). 280,000 stop strings (a 4 MB
body) were searched one by one in every step on the worker's engine thread, ~110 ms a step for
every request there, and a second pass found 128 strings of ~1,250 characters cost ~120 ms a step
(the search is quadratic in the worst case); a request may now hold at most MAX_STOP_STRINGS, of
at most MAX_STOP_STRING_CHARS characters each and MAX_STOP_CHARS in all."""

from __future__ import annotations

import httpx
import pytest

from pdserve.engine.sequence import MAX_STOP_CHARS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.api.served_cli import serve_logged, stop, wait_healthy
from tests.runtime.conftest import prompt

IDS = list(prompt(24, 5))


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    proc, port = serve_logged(tmp_path_factory.mktemp("sampling") / "serve.log")
    try:
        wait_healthy(port, 180.0)
        yield port
    finally:
        stop(proc)


def complete(port: int, **fields) -> httpx.Response:
    body = {"model": "tiny", "prompt": IDS, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True, **fields}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("fields", [
    {"temperature": 1e-300},  # 0 in fp32: the logits were divided by zero
    {"temperature": 1e-40},  # an fp32 subnormal: the logits overflowed to inf
    {"temperature": 9e-6},  # below vLLM's 1e-5: greedy there too
    {"temperature": 1.0, "top_p": 1e-300, "seed": 3},  # every token was dropped
    {"temperature": 1.0, "top_p": 1e-9, "seed": 3},  # keeps the most likely token alone
    {"temperature": 1.0, "top_k": 1, "seed": 3},  # the same, by top-k (it held before)
], ids=["temperature 1e-300", "temperature 1e-40", "temperature 9e-6", "top_p 1e-300", "top_p 1e-9", "top_k 1"])
def test_a_vanishing_temperature_or_top_p_samples_the_greedy_tokens(port, fields):
    greedy = tokens(complete(port, temperature=0.0))
    assert tokens(complete(port, **fields)) == greedy
    assert tokens(complete(port, stream=False, n=2, **fields)) == greedy  # choice 0 of n as well


@pytest.mark.parametrize("fields", [{"temperature": 3.5e38, "min_tokens": 5}, {"temperature": 1e300}],
                         ids=["temperature 3.5e38", "temperature 1e300"])
def test_a_temperature_past_fp32_is_refused(port, fields):
    response = complete(port, **fields)
    assert response.status_code == 400, response.text
    assert "temperature" in response.json()["error"]["message"]
    assert len(tokens(complete(port, temperature=1e38, min_tokens=5, seed=1))) == 12  # finite in fp32: served


@pytest.mark.parametrize("penalty", [1e-300, 1e-39, 1e-30, 1e39])
def test_a_repetition_penalty_outside_fp32_is_refused(port, penalty):
    response = complete(port, repetition_penalty=penalty)
    assert response.status_code == 400, response.text
    assert "repetition_penalty" in response.json()["error"]["message"]
    assert tokens(complete(port, repetition_penalty=1.2)) != []  # the server goes on


def test_stop_strings_are_capped_and_the_server_goes_on(port):
    many = [f"never-{i}" for i in range(MAX_STOP_STRINGS + 1)]
    response = complete(port, stop=many)
    assert response.status_code == 400, response.text
    assert f"at most {MAX_STOP_STRINGS}" in response.json()["error"]["message"]
    huge = complete(port, stop=[f"x{i}" for i in range(280_000)])  # the attack's size, a 2.5 MB body
    assert huge.status_code == 400, huge.text[:200]
    greedy = tokens(complete(port, temperature=0.0))
    assert tokens(complete(port, temperature=0.0, stop=many[:MAX_STOP_STRINGS])) == greedy  # the cap itself is served
    long_ones = ["\x1a" * 998 + "Z" + "\x1a" * k for k in range(127)] + ["Q" * 1249]  # the second pass's attack
    response = complete(port, stop=long_ones)
    assert response.status_code == 400 and f"at most {MAX_STOP_STRING_CHARS} characters" in response.text
    longest = ["x" * MAX_STOP_STRING_CHARS] * (MAX_STOP_CHARS // MAX_STOP_STRING_CHARS)
    assert tokens(complete(port, temperature=0.0, stop=longest)) == greedy  # at both length caps: served
    assert complete(port, stop=longest + ["y"]).status_code == 400  # one character over the total
