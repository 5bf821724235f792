"""Block events (engine/kv/kv_events.py) mirror the prefix cache exactly; the chain root covers the
model, the K/V ABI and (as a seam) the tenant."""

from __future__ import annotations

import hashlib
import random

import pytest

from pdserve.engine.kv.block_manager import BlockManager, root_hash
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.kv_abi import CacheIdentity, KvAbi
from pdserve.engine.kv.kv_events import BlockEventKind, BlockEventLog
from pdserve.engine.sequence import SamplingParams
from pdserve.router.kv.kv_index import KvDelta, KvIndex, KvOutcome, hash_key


def cache_keys(blocks: BlockManager) -> set[int]:
    return {hash_key(h) for h in blocks.cached}


def test_applied_reports_equal_the_prefix_cache_through_inserts_and_evictions():
    """A 24-block pool serving prompts that share prefixes: blocks are cached, reused and evicted;
    after every step the index fed only the engine's reports holds exactly `cached`'s keys."""
    engine = Engine(EngineConfig(model="tiny", num_blocks=24, max_num_batched_tokens=64))
    index = KvIndex()
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(48)]
    assert index.apply("w", 1, KvDelta.from_report(engine.blocks.kv_report(resync=True))).outcome is KvOutcome.RESYNCED
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    shipped = 0
    for i in range(12):
        prompt = shared[: rng.choice((16, 32, 48))] + [rng.randrange(3, 200) for _ in range(rng.randrange(0, 70))]
        engine.add_request(f"r{i}", prompt, params, seed=i)
        while engine.has_unfinished():
            engine.step()
            report = engine.blocks.kv_report()
            shipped += len(report.events)
            assert not report.resync and index.apply("w", 1, KvDelta.from_report(report)).outcome in (
                KvOutcome.APPLIED, KvOutcome.IGNORED)
            assert set(index.held("w")) == cache_keys(engine.blocks)
    assert engine.blocks.num_evictions > 0 and engine.blocks.num_prefix_hits > 0  # both paths were taken
    assert engine.blocks.events.seq == shipped  # every numbered event was shipped once, none dropped
    engine.check_integrity()


def test_every_event_is_numbered_and_a_full_log_turns_into_a_resync():
    blocks = BlockManager(8, 4, "identity")
    blocks.events = BlockEventLog(capacity=3)
    (b0, b1) = blocks.allocate(2)
    blocks.register(b0, b"h0" * 8, (1, 2, 3, 4))
    blocks.register(b1, b"h1" * 8, (5, 6, 7, 8))
    blocks.register(b1, b"h1" * 8, (5, 6, 7, 8))  # already cached: no event
    report = blocks.kv_report()
    assert (report.first_seq, report.last_seq, report.resync) == (1, 2, False)
    stored = BlockEventKind.STORED
    assert [(e.kind, e.block_hash) for e in report.events] == [(stored, b"h0" * 8), (stored, b"h1" * 8)]
    assert blocks.kv_report().events == () and blocks.kv_report().last_seq == 2  # nothing new
    blocks.release([b0, b1])
    taken = blocks.allocate(8)  # every free block, then the two cached ones: both evicted
    assert blocks.num_evictions == 2 and not blocks.cached
    report = blocks.kv_report()
    assert report.last_seq == 4 and [e.kind for e in report.events] == [BlockEventKind.REMOVED] * 2
    for i, b in enumerate(taken[:4]):
        blocks.register(b, bytes([i]) * 16, (i,) * 4)  # 4 events > capacity 3: the log overflows
    report = blocks.kv_report()
    assert report.resync and report.last_seq == 8
    assert {e.block_hash for e in report.events} == set(blocks.cached)
    assert {e.kind for e in report.events} == {BlockEventKind.STORED}
    blocks.release(taken)


def test_the_chain_root_covers_the_model_and_the_kv_abi():
    def identity(abi: KvAbi, model: str = "m") -> str:
        return CacheIdentity(model_hash=model, tokenizer_hash="t", abi_hash=abi.abi_hash).identity_hash

    base = KvAbi(2, 2, 32, 16, "bfloat16")
    roots = {root_hash(identity(a)) for a in (base, KvAbi(2, 2, 32, 16, "float32"), KvAbi(2, 2, 32, 32, "bfloat16"),
                                               KvAbi(2, 2, 32, 16, "bfloat16", partition="tp2-pp1"))}
    roots.add(root_hash(identity(base, model="other")))
    assert len(roots) == 5
    engine = Engine(EngineConfig(model="tiny", num_blocks=8))
    assert engine.identity.abi_hash == engine.abi.abi_hash  # the engine's root is over this identity
    assert engine.blocks.identity == root_hash(engine.identity.identity_hash)


def test_the_tenant_seam_keeps_the_default_root_and_separates_others():
    legacy = hashlib.blake2b(b"pdserve-prefix-root|" + b"ident", digest_size=16).digest()
    assert root_hash("ident") == root_hash("ident", "default") == legacy
    assert root_hash("ident", "tenant-b") != legacy


@pytest.mark.parametrize("capacity", [0, -1])
def test_an_event_log_needs_room(capacity):
    with pytest.raises(ValueError):
        BlockEventLog(capacity)
