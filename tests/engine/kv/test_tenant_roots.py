"""Bounded tenants (issue 36, part 5): the block manager keeps at most `max_tenant_roots` tenants'
chain roots, least recently used out; a root computed again is the same root, so hits survive."""

from __future__ import annotations

import random

import pytest

from pdserve.api.tenants import TenantResolver
from pdserve.engine.kv.block_manager import DEFAULT_MAX_TENANT_ROOTS, DEFAULT_TENANT, BlockManager, root_hash
from pdserve.engine.config import EngineConfig

IDENTITY = "test-identity"
TOKENS = list(range(40))


def test_ten_thousand_salts_keep_the_table_at_its_bound_and_a_busy_tenant_in_it():
    blocks = BlockManager(64, 16, IDENTITY, max_tenant_roots=128)
    resolver, rng = TenantResolver(), random.Random(0)
    busy = resolver.tenant(None, "busy")
    for i in range(10_000):
        blocks.hashes_for(TOKENS, resolver.tenant(None, f"{rng.getrandbits(64):x}"))
        if i % 50 == 0:
            blocks.hashes_for(TOKENS, busy)  # a tenant in use is touched: never the least recently used
        assert blocks.num_tenant_roots <= 128
    assert blocks.num_tenant_roots == 128 and busy in blocks._roots
    evicted = resolver.tenant(None, "never-again")
    first = blocks.hashes_for(TOKENS, evicted)
    for i in range(200):
        blocks.root_for(f"t{i}")
    assert evicted not in blocks._roots and blocks.hashes_for(TOKENS, evicted) == first  # computed again, equal
    assert blocks.root_for(evicted) == root_hash(IDENTITY, evicted)
    assert blocks.root_for(DEFAULT_TENANT) == root_hash(IDENTITY) and DEFAULT_TENANT not in blocks._roots


def test_the_bound_has_a_default_and_refuses_zero():
    assert EngineConfig().max_tenant_roots == DEFAULT_MAX_TENANT_ROOTS == 1024
    assert BlockManager(8, 16, IDENTITY).max_tenant_roots == DEFAULT_MAX_TENANT_ROOTS
    with pytest.raises(ValueError):
        BlockManager(8, 16, IDENTITY, max_tenant_roots=0)
