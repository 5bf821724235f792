"""A request whose n choices could never fit a decode worker, even with the cluster idle, is a 400
naming n (no Retry-After), never a 503 a client would retry; one that fits is served
(router/process/frontend_start.py `refuse_never_fitting`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from tests.runtime.conftest import config, prompt, wait_baseline
from tests.runtime.served_http import served_app


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_n_that_can_never_fit_is_a_400_naming_n(mode):
    async def main():
        async with cluster(config(mode=mode, engine=EngineConfig(model="tiny", num_blocks=8))) as (backend, _):
            async with served_app(backend) as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                body = {"model": "tiny", "prompt": list(prompt(10, 1)), "max_tokens": 20, "ignore_eos": True}
                never = await c.post("/v1/completions", json={**body, "n": 8})  # 18 blocks; each worker has 8
                assert never.status_code == 400, never.text
                error = never.json()["error"]
                assert (error["param"], error["code"]) == ("n", "context_length_exceeded") and "Retry-After" not in never.headers
                fits = await c.post("/v1/completions", json={**body, "n": 2})
                assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
                # at the boundary the count is the decode worker's own (ledger/kv.py fork_blocks): a
                # 32-token prompt (2 blocks, none partial) and 2 choices of 48 tokens take 2 + 2 x 3 = 8
                # blocks, the whole pool, and are served; 49 tokens each take 2 + 2 x 4 = 10
                edge = {**body, "prompt": list(prompt(32, 2)), "n": 2, "return_token_ids": True}
                whole = await c.post("/v1/completions", json={**edge, "max_tokens": 48})
                assert whole.status_code == 200, whole.text
                assert [len(ch["token_ids"]) for ch in whole.json()["choices"]] == [48, 48]
                over = await c.post("/v1/completions", json={**edge, "max_tokens": 49})
                assert over.status_code == 400 and "needs 10 K/V blocks" in over.json()["error"]["message"], over.text
                # two that each fit an idle worker but not together: short of room only for now, so
                # the second waits in admission (or, past its wait, is a 503), never a 400
                big = {**body, "max_tokens": 90}  # 7 of the 8 blocks
                answers = await asyncio.gather(*(c.post("/v1/completions", json=big) for _ in range(2)))
                assert sorted(a.status_code for a in answers)[0] == 200, [a.text for a in answers]
                assert {a.status_code for a in answers} <= {200, 503}, [a.text for a in answers]
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())
