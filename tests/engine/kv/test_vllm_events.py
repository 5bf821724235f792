"""The vLLM-shaped block events (engine/kv/vllm_events.py) of a real block manager: replayed from
the first batch they hold exactly what the device pool and the host tier hold, and the sink
remembers no more blocks than the tiers do."""

from __future__ import annotations

import random

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.vllm_events import BlockRemoved, KVEventBatch, VllmEventSink
from pdserve.engine.sequence import SamplingParams

BLOCK = 16


def cache_distinct_prompts(blocks: BlockManager, rounds: int, blocks_per_prompt: int = 2) -> None:
    """Each round caches a prompt no earlier round shares a block with, then frees it: the pool's
    LRU evicts the oldest cached blocks as it fills."""
    for r in range(rounds):
        tokens = [(r * 7 + i) % 50_000 for i in range(BLOCK * blocks_per_prompt)]
        hashes = blocks.hashes_for(tokens)
        table = blocks.allocate(blocks_per_prompt)
        for j, (block, h) in enumerate(zip(table, hashes)):
            blocks.register(block, h, tuple(tokens[j * BLOCK:(j + 1) * BLOCK]), hashes[j - 1] if j else None)
        blocks.release(table)
        blocks.vllm_events.take()


def test_without_a_host_tier_the_sink_forgets_evicted_blocks():
    """--kv-events-endpoint with --host-kv-mb 0: every eviction is a removal from the last tier,
    so the sink's memory stays within the 64-block pool however many blocks pass through it."""
    blocks = BlockManager(64, BLOCK, "tiny")
    blocks.vllm_events = sink = VllmEventSink(BLOCK)
    cache_distinct_prompts(blocks, 2000)
    assert blocks.num_evictions > 3000 and len(blocks.cached) == 64
    assert len(sink._known) == 64  # was every block ever cached: 4,000 here
    assert set(sink._known) == set(blocks.cached)


def replayed_tiers(batches: list[bytes]) -> tuple[set[bytes], set[bytes]]:
    """The (GPU, CPU) block sets an indexer holds after applying every batch from the first, as
    vLLM's subscribers decode them (plain msgpack: [ts, [[tag, *fields], ...]])."""
    media: dict[bytes, set[str]] = {}
    for payload in batches:
        for tag, *fields in msgspec.msgpack.decode(payload)[1]:
            if tag == "AllBlocksCleared":
                media.clear()
            elif tag == "BlockStored":
                for h in fields[0]:
                    media.setdefault(h, set()).add(fields[5])
            elif tag == "BlockRemoved":
                for h in fields[0]:
                    media.get(h, set()).discard(fields[1])
    return ({h for h, m in media.items() if "GPU" in m}, {h for h, m in media.items() if "CPU" in m})


def test_the_events_follow_the_host_tier_through_promotions_and_discards():
    """A 20-block pool with an 8-block host tier serves prompts over five shared documents: blocks
    are demoted, evicted from the tier, promoted back on a hit, and recomputed (the tier's copy
    discarded) when the chain's first block left the tier. After every request the events, applied
    from the first batch, hold exactly what each tier holds."""
    engine = Engine(EngineConfig(model="tiny", num_blocks=20, num_threads=1))
    engine = Engine(EngineConfig(model="tiny", num_blocks=20, num_threads=1, host_kv_bytes=8 * engine.abi.bytes_per_block))
    blocks, host = engine.blocks, engine.blocks.host
    blocks.vllm_events = sink = VllmEventSink(engine.abi.block_size)
    encoder, batches = msgspec.msgpack.Encoder(), []
    rng = random.Random(11)
    docs = [[rng.randrange(3, 256) for _ in range(64)] for _ in range(5)]
    removed_from_host = 0
    for i in range(30):
        tail = [rng.randrange(3, 256) for _ in range(rng.randrange(0, 40))]
        engine.generate([docs[rng.randrange(5)] + tail], SamplingParams(max_tokens=2, ignore_eos=True, seed=i))
        batch = sink.take() or KVEventBatch(0.0, [])  # None: the cache did not change
        removed_from_host += sum(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in batch.events)
        batches.append(encoder.encode(batch))
        assert replayed_tiers(batches) == (set(blocks.cached), set(host.lru)), f"after request {i}"
    assert host.num_hits > 0 and host.num_evictions > 0  # promotions and the tier's own evictions
    assert removed_from_host > host.num_evictions  # and drops that are neither: promotions, discards
    assert sink.held() == {**{h: {"CPU"} for h in host.lru}, **{h: {"GPU"} for h in blocks.cached}}
    sink.snapshot()  # what a subscriber that just joined gets: on its own, the same tiers
    assert replayed_tiers([encoder.encode(sink.take())]) == (set(blocks.cached), set(host.lru))
    engine.check_integrity()
    engine.assert_no_leaks()
