"""Tenant isolation of the prefix cache (api/tenants.py, engine/kv/block_manager.py `root_for`):
a client cannot pick another tenant; identical prompts of two tenants never share cached K/V,
while one tenant's repeat hits; the tokens are the same either way."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.api.app import create_app
from pdserve.api.errors import ApiError
from pdserve.api.tenants import TenantResolver, load_api_keys
from pdserve.engine.kv.block_manager import DEFAULT_TENANT
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams

PROMPT = list(range(5, 69))  # four full 16-token blocks


def test_keys_pick_the_tenant_and_a_salt_only_salts_within_it(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant\nk-alice alice\nk-bob bob\n")
    keys = load_api_keys(path)
    assert keys == {"k-alice": "alice", "k-bob": "bob"}
    resolver = TenantResolver(keys)
    assert resolver.tenant("Bearer k-alice", None) == "alice"
    assert resolver.tenant("bearer k-bob", "s").startswith("bob/salt-")
    for header in (None, "Bearer nope", "Basic k-alice", "Bearer "):
        with pytest.raises(ApiError) as err:
            resolver.tenant(header, None)
        assert err.value.info.status == 401 and err.value.info.code == "invalid_api_key"
    open_server = TenantResolver()
    assert open_server.tenant("Bearer anything", None) == DEFAULT_TENANT
    assert open_server.tenant(None, "x") == open_server.tenant(None, "x") != open_server.tenant(None, "y")
    assert open_server.tenant(None, "alice") != "alice"  # a salt never names a tenant outright
    (tmp_path / "bad").write_text("just-a-key\n")
    with pytest.raises(ValueError):
        load_api_keys(tmp_path / "bad")


def test_two_tenants_with_one_prompt_share_no_cached_block_while_one_tenant_hits():
    engine = Engine(EngineConfig(model="tiny", num_blocks=128, num_threads=1))
    params = {t: SamplingParams(max_tokens=4, ignore_eos=True, tenant=t) for t in ("alice", "bob", DEFAULT_TENANT)}
    runs = [(t, engine.generate([PROMPT], params[t])[0]) for t in ("alice", "alice", "bob", "bob", DEFAULT_TENANT)]
    cached = [out.num_cached_tokens for _, out in runs]
    assert cached == [0, 48, 0, 48, 0]  # the last token is always computed: 3 of 4 blocks hit
    assert len({tuple(out.output_ids) for _, out in runs}) == 1
    engine.check_integrity()


def test_http_requests_run_in_their_key_s_tenant(backend, tmp_path):
    app = create_app(backend, api_keys={"k-alice": "alice", "k-bob": "bob"})
    body = {"model": "tiny-test", "prompt": list(range(150, 214)), "max_tokens": 3, "temperature": 0}

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            anonymous = await client.post("/v1/completions", json=body)
            answers = [await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {k}"})
                       for k in ("k-alice", "k-alice", "k-bob")]
            salted = await client.post("/v1/completions", json={**body, "cache_salt": "x"},
                                       headers={"Authorization": "Bearer k-alice"})
            return anonymous, answers, salted

    anonymous, answers, salted = asyncio.run(calls())
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert [a.status_code for a in answers] == [200, 200, 200] and salted.status_code == 200, answers[0].text
    texts = {a.json()["choices"][0]["text"] for a in (*answers, salted)}
    assert len(texts) == 1
    tenants = backend.run_on_engine(lambda e: sorted(e.blocks._roots)).result(60)
    assert {"alice", "bob"} <= set(tenants) and any(t.startswith("alice/salt-") for t in tenants)
