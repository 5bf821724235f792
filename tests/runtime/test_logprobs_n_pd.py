"""Logprobs, prompt logprobs and n > 1 across the prefill -> decode handoff equal colocated serving
(real worker processes, tiny model), over the backend and over HTTP; the pools end at baseline."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import uvicorn

from pdserve.api.app import create_app
from pdserve.api.backend import FinishEvent, GenerationRequest, TokenEvent
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from pdserve.ports import free_local_port
from tests.runtime.conftest import config, prompt, wait_baseline

CASES = [  # (prompt, params): the first token of each comes from the prefill worker in P/D
    (prompt(40, 1), SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)),
    (prompt(300, 2), SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3, logprobs=0,
                                     prompt_logprobs=2)),  # long enough for layer-wise streaming
    (prompt(300, 2), SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3, logprobs=0,
                                     prompt_logprobs=2)),  # the same prompt again: the prefix cache has it
    (prompt(37, 4), SamplingParams(max_tokens=7, ignore_eos=True, temperature=1.0, seed=5, n=3, logprobs=1)),
    (prompt(37, 5), SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0, seed=6, n=3)),  # all end at prefill
]
HTTP_BODY = {"model": "tiny", "prompt": list(prompt(50, 6)), "max_tokens": 4, "echo": True, "logprobs": 2, "n": 2,
             "seed": 9, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}


async def events(backend, rid: str, ids, params) -> tuple[dict, object, tuple | None]:
    """-> ({index: [(token ids, logprobs)...]}, finish event, prompt logprobs)."""
    per: dict[int, list] = {}
    prompt_lps = None
    async for event in backend.submit(GenerationRequest(rid, tuple(ids), params)):
        if isinstance(event, TokenEvent):
            per.setdefault(event.index, []).append((event.token_ids, event.logprobs, event.finish_reason))
            prompt_lps = event.prompt_logprobs if event.prompt_logprobs is not None else prompt_lps
        else:
            return per, event, prompt_lps
    return per, None, prompt_lps


async def serve_all(cfg) -> tuple[list, dict]:
    port = free_local_port()
    async with cluster(replace(cfg, port=port)) as (backend, _):
        results = [await events(backend, f"r{i}", p, s) for i, (p, s) in enumerate(CASES)]
        server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=120) as client:
            body = (await client.post(f"http://127.0.0.1:{port}/v1/completions", json=HTTP_BODY)).json()
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        server.should_exit = True
        await task
        return results, body


def test_logprobs_and_n_over_the_handoff_equal_colocated():
    pd, pd_body = asyncio.run(serve_all(config()))
    co, co_body = asyncio.run(serve_all(config(mode="colocated", replicas=1)))
    for (p, s), (pd_per, pd_end, pd_prompt), (co_per, co_end, co_prompt) in zip(CASES, pd, co):
        assert isinstance(pd_end, FinishEvent) and isinstance(co_end, FinishEvent)
        assert sorted(pd_per) == list(range(s.n))
        assert pd_per == co_per  # tokens, logprobs (the first from the prefill worker) and finishes, bitwise
        for steps in pd_per.values():
            assert sum(len(ids) for ids, _, _ in steps) == s.max_tokens
            assert all(len(lps) == (len(ids) if s.logprobs is not None else 0) for ids, lps, _ in steps)
        if s.prompt_logprobs is not None:
            assert pd_prompt == co_prompt and len(pd_prompt) == len(p) - 1
            assert [lp.token_id for lp in pd_prompt] == list(p[1:])
    assert pd[1][2] == pd[2][2]  # the repeated prompt is scored again, not skipped through the cache
    assert pd_body["choices"] == co_body["choices"] and [c["index"] for c in pd_body["choices"]] == [0, 1]
    for choice in pd_body["choices"]:
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == 50 + 4
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert pd_body["usage"]["completion_tokens"] == 8
