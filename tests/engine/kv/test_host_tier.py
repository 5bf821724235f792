"""The host-memory tier (engine/kv/host_tier.py) under a tiny engine with a small device pool:
evicted prefix blocks are demoted (DEMOTED events) instead of forgotten, a later prompt with that
prefix promotes them back (PROMOTED) with K/V bitwise equal to a recompute and the same tokens,
the tier evicts its own least recent block when full (REMOVED, tier HOST), a resync reports both
tiers, and the pool and the tier pass their integrity checks after every scenario."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.kv_events import BlockEventKind, KvTier
from pdserve.engine.sequence import SamplingParams

BASE = EngineConfig(model="tiny", num_blocks=20, num_threads=1)
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, seed=5)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


@pytest.fixture(scope="module")
def block_bytes() -> int:
    return Engine(BASE).abi.bytes_per_block


def events(engine: Engine):
    return engine.blocks.kv_report().events


def evict_everything(engine: Engine) -> None:
    """Fill the 20-block pool with other prompts twice over: every earlier cached block goes."""
    for seed in range(100, 104):
        engine.generate([prompt(150, seed)], PARAMS)


def test_evicted_blocks_are_demoted_and_a_hit_promotes_them_bitwise(block_bytes):
    engine = Engine(replace(BASE, host_kv_bytes=40 * block_bytes))
    history = prompt(100, 1)  # six full blocks
    engine.generate([history], PARAMS)
    hashes = engine.blocks.hashes_for(history)[:6]
    events(engine)  # drop the STORED events so far
    evict_everything(engine)
    demoted = {e.block_hash for e in events(engine) if e.kind is BlockEventKind.DEMOTED and e.tier is KvTier.HOST}
    assert set(hashes) <= demoted and not set(hashes) & set(engine.blocks.cached)
    turn2 = history + prompt(30, 2)
    out = engine.generate([turn2], PARAMS)[0]
    assert out.num_cached_tokens == 96  # served from the host tier
    promoted = [e.block_hash for e in events(engine) if e.kind is BlockEventKind.PROMOTED]
    assert promoted[:6] == hashes and engine.blocks.host.num_hits == 6
    fresh = Engine(BASE)
    assert fresh.generate([turn2], PARAMS)[0].output_ids == out.output_ids
    for h in hashes:  # the promoted blocks hold exactly the recomputed K/V
        assert torch.equal(engine.pool.tensor[:, :, engine.blocks.cached[h]], fresh.pool.tensor[:, :, fresh.blocks.cached[h]])
    engine.check_integrity()
    engine.assert_no_leaks()


def test_the_tier_evicts_its_least_recent_block_and_a_resync_reports_both_tiers(block_bytes):
    engine = Engine(replace(BASE, host_kv_bytes=4 * block_bytes))  # room for four blocks only
    history = prompt(100, 3)
    engine.generate([history], PARAMS)
    events(engine)
    evict_everything(engine)
    report = events(engine)
    host_removed = [e for e in report if e.kind is BlockEventKind.REMOVED and e.tier is KvTier.HOST]
    assert host_removed and engine.blocks.host.num_used == 4 and engine.blocks.host.num_evictions == len(host_removed)
    assert engine.generate([history + prompt(20, 4)], PARAMS)[0].num_cached_tokens == 0  # its first block left the tier
    resync = engine.blocks.kv_report(resync=True)
    tiers = {e.block_hash: e.tier for e in resync.events}
    assert set(tiers) == set(engine.blocks.cached) | set(engine.blocks.host.lru)
    assert {tiers[h] for h in engine.blocks.host.lru} == {KvTier.HOST}
    engine.check_integrity()
    engine.assert_no_leaks()


def test_without_a_tier_evictions_are_removals():
    engine = Engine(BASE)
    engine.generate([prompt(100, 5)], PARAMS)
    events(engine)
    evict_everything(engine)
    kinds = {e.kind for e in events(engine)}
    assert BlockEventKind.DEMOTED not in kinds and BlockEventKind.REMOVED in kinds and engine.blocks.host is None
