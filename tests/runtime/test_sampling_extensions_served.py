"""vLLM's min_tokens, stop_token_ids and repetition_penalty over the prefill -> decode handoff
equal colocated serving (real worker processes, tiny model, HTTP: completions and chat, streamed
or not, n > 1), and hold vLLM's semantics (api/extensions.py, engine/logits_processors.py)."""

from __future__ import annotations

import asyncio
import json

import httpx

from pdserve.api.protocol import SCRIPTED_EOS_HEADER
from pdserve.api.server import cluster
from tests.runtime.conftest import config, prompt, wait_baseline
from tests.runtime.served_http import served_app

PROMPT = list(prompt(40, 11))
GREEDY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True, "repetition_penalty": 1.5}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 10, "ignore_eos": True,
        "return_token_ids": True}


def first_new(tokens: list[int], start: int) -> int:
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def cases(base: list[int]) -> list[tuple[str, dict, dict]]:
    """(route, body, headers): stop ids picked from the deployment's own greedy run `base`."""
    k = first_new(base, 2)
    sampled = {"temperature": 1.0, "seed": 7, "n": 3, "repetition_penalty": 1.2}
    return [
        ("/v1/completions", {**GREEDY, "stop_token_ids": [base[k]]}, {}),  # ends on the decode worker
        ("/v1/completions", {**GREEDY, "stop_token_ids": [base[0]]}, {}),  # ends on the prefill worker
        ("/v1/completions", {**GREEDY, "stop_token_ids": [base[k]], "min_tokens": k + 2, "stream": True}, {}),
        ("/v1/completions", {**GREEDY, **sampled, "min_tokens": 4, "stop_token_ids": base[:3], "stream": True}, {}),
        ("/v1/chat/completions", {**CHAT, **sampled, "min_tokens": 3, "stop_token_ids": base[:3]}, {}),
        ("/v1/chat/completions", {**CHAT, **sampled, "min_tokens": 2, "stop_token_ids": base[:3], "stream": True}, {}),
        ("/v1/completions", {**GREEDY, "ignore_eos": False, "min_tokens": 5}, {SCRIPTED_EOS_HEADER: "2"}),
    ]


async def answer(client, route: str, body: dict, headers: dict) -> dict[int, tuple[list[int], str, str]]:
    """-> {choice index: (token ids, text, finish reason)}, streamed or not."""
    response = await client.post(route, json=body, headers=headers)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return {c["index"]: (c["token_ids"], c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"])
                for c in response.json()["choices"]}
    per: dict[int, tuple[list[int], str, str]] = {}
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            ids, text, reason = per.get(c["index"], ([], "", None))
            piece = c.get("text", (c.get("delta") or {}).get("content")) or ""
            per[c["index"]] = (ids + list(c.get("token_ids") or ()), text + piece, c["finish_reason"] or reason)
    return per


async def serve_cases(cfg) -> tuple[list[int], list[dict]]:
    async with cluster(cfg) as (backend, _):
        async with served_app(backend) as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            base = (await answer(client, "/v1/completions", GREEDY, {}))[0][0]
            results = [await answer(client, *case) for case in cases(base)]
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
    return base, results


def test_extensions_over_the_handoff_equal_colocated_and_hold_their_semantics():
    pd_base, pd = asyncio.run(serve_cases(config()))
    co_base, co = asyncio.run(serve_cases(config(mode="colocated", replicas=1)))
    assert pd_base == co_base and pd == co  # tokens, texts and finish reasons of every choice
    k = first_new(pd_base, 2)
    assert pd[0] == {0: (pd_base[: k + 1], pd[0][0][1], "stop")} and pd[1][0][0] == pd_base[:1]
    assert pd[1][0][2] == "stop" and pd[1][0][1] == ""  # the stop id's text is not in the output
    held = pd[2][0][0]
    assert held[:k] == pd_base[:k] and pd_base[k] not in held[: k + 2] and len(held) >= k + 2
    for (_, body, _), result in zip(cases(pd_base)[3:6], pd[3:6]):
        assert sorted(result) == list(range(body["n"]))
        for ids, _, reason in result.values():
            assert len(ids) >= body["min_tokens"] and not set(ids[: body["min_tokens"]]) & set(body["stop_token_ids"])
            assert reason == ("stop" if ids[-1] in body["stop_token_ids"] else "length") and len(ids) <= body["max_tokens"]
    assert [(len(ids), reason) for ids, _, reason in pd[6].values()] == [(5, "stop")]  # not at the scripted 2

