"""The vLLM-shaped block events (engine/kv/vllm_events.py) of a real block manager: the sink
remembers no more blocks than the tiers hold."""

from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.vllm_events import VllmEventSink

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
