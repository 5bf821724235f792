"""A K/V pool's pages become resident as the engine first uses its blocks (kv_pool.py "on_use"), a
whole extent at a time and before anything writes them, never at creation; the bytes are unchanged."""

from __future__ import annotations

import ctypes
import mmap
import uuid

import numpy as np
import pytest

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.engine.kv.kv_pool import POPULATE_EXTENT, KvPool
from pdserve.engine.sequence import SamplingParams

ABI = KvAbi(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")  # a block's slab: one page
_libc = ctypes.CDLL(None, use_errno=True)


def resident_blocks(pool: KvPool) -> list[list[bool]]:
    """Per layer's K and V slab, whether each block's pages are resident (mincore)."""
    assert pool.abi.slab_bytes % mmap.PAGESIZE == 0  # whole pages per block (tiny's and ABI's slabs: one)
    raw = pool._raw
    pages = -(-pool.nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(ctypes.c_void_p(raw.ctypes.data), ctypes.c_size_t(pool.nbytes), vec) == 0
    per_block = pool.abi.slab_bytes // mmap.PAGESIZE
    flags = np.frombuffer(vec, dtype=np.uint8) & 1
    return [[bool(flags[(lkv * pool.num_blocks + b) * per_block: (lkv * pool.num_blocks + b + 1) * per_block].all())
             for b in range(pool.num_blocks)] for lkv in range(pool.abi.num_layers * 2)]


def _pool(shared: bool, resident: str, num_blocks: int = 3 * POPULATE_EXTENT - 10) -> KvPool:
    return KvPool(ABI, num_blocks, shm_name=f"pdtest-kv-{uuid.uuid4().hex[:12]}" if shared else None, resident=resident)


@pytest.mark.parametrize("shared", [True, False])
def test_blocks_become_resident_by_extent_as_the_block_manager_first_hands_them_out(shared):
    assert ABI.slab_bytes == mmap.PAGESIZE
    pool = _pool(shared, "on_use")
    try:
        assert not any(r[b] for r in resident_blocks(pool) for b in range(1, pool.num_blocks))  # only the probed page
        blocks = BlockManager(pool.num_blocks, ABI.block_size, "id")
        blocks.on_grow = pool.populate
        first = blocks.allocate(10)
        assert first == list(range(10)) and blocks.high_water == 10 and pool.populated == POPULATE_EXTENT
        assert all(r == [True] * POPULATE_EXTENT + [False] * (pool.num_blocks - POPULATE_EXTENT) for r in resident_blocks(pool))
        pool.write_chunk(1, [3], np.arange(2 * ABI.slab_elems, dtype=np.int16).tobytes())
        blocks.release(first)
        second = blocks.allocate(POPULATE_EXTENT)  # the never-used blocks first: 10.., past the first extent
        assert second == list(range(10, 10 + POPULATE_EXTENT)) and pool.populated == 2 * POPULATE_EXTENT
        rest = blocks.allocate(blocks.num_free)  # the last extent is short: the pool ends first
        assert pool.populated == pool.num_blocks and blocks.high_water == pool.num_blocks
        assert all(all(r) for r in resident_blocks(pool))
        written = np.frombuffer(pool.read_chunk(1, [3]), dtype=np.int16)
        assert np.array_equal(written, np.arange(2 * ABI.slab_elems, dtype=np.int16))  # populating wrote nothing
        assert not np.frombuffer(pool.read_chunk(0, [b for b in range(pool.num_blocks) if b != 3]), dtype=np.int16).any()
        blocks.release(second + rest)
        blocks.check_integrity()
        blocks.assert_baseline()
    finally:
        pool.close(unlink=True)


@pytest.mark.parametrize("shared", [True, False])
def test_resident_all_maps_every_page_at_creation_and_lazy_none(shared):
    for resident, expected in (("all", True), ("lazy", False)):
        pool = _pool(shared, resident)
        try:
            assert all(r[1:] == [expected] * (pool.num_blocks - 1) for r in resident_blocks(pool))
            pool.populate(5)  # only "on_use" populates on demand
            assert pool.populated == (pool.num_blocks if expected else 0)
        finally:
            pool.close(unlink=True)


def test_the_engine_pool_holds_resident_only_the_blocks_it_used():
    engine = Engine(EngineConfig(model="tiny", kv_cache_bytes=64 << 20, max_num_batched_tokens=256))
    try:
        pool = engine.pool
        assert pool.resident == "on_use" and pool.populated == 0 and engine.blocks.high_water == 0
        engine.add_request("a", list(range(3, 203)), SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        used = engine.blocks.high_water
        assert 0 < used <= pool.populated == POPULATE_EXTENT < pool.num_blocks
        assert all(not any(r[POPULATE_EXTENT:]) for r in resident_blocks(pool))
        engine.check_integrity()
    finally:
        engine.close()
