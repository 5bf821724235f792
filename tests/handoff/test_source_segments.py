"""One source address space over a device pool and a host tier (handoff/segments.py): addresses
map to (segment, slot) with a gap between segments, so a chunk whose blocks come from both
hashes, gathers and copies exactly the bytes of each block where it lives; gaps and
out-of-range addresses name nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.kvbytes import (checksum_views, chunk_checksum, chunk_nbytes, chunk_views, copy_and_checksum,
                                     gather_chunk, pool_bytes)
from pdserve.handoff.segments import SourceSegments

ABI = KvAbi(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def filled(num_blocks: int, seed: int) -> KvPool:
    pool = KvPool(ABI, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(pool.shape, generator=gen).to(torch.bfloat16))
    return pool


def test_addresses_gaps_and_runs():
    space = SourceSegments([pool_bytes(filled(5, 1)), pool_bytes(filled(3, 2))], ["dev", "host"])
    assert [space.address(0, 4), space.address(1, 0), space.address(1, 2)] == [4, 6, 8]
    assert [space.locate(a) for a in (0, 4, 5, 6, 8, 9, -1)] == [(0, 0), (0, 4), None, (1, 0), (1, 2), None, None]
    assert space.shape[2] == 9 and not space.valid(5)
    with pytest.raises(IndexError):
        space[0, 0, 4:7]  # crosses the gap: never produced by block_runs over valid addresses
    with pytest.raises(ValueError):
        space.address(1, 3)


def test_a_mixed_chunk_reads_each_block_where_it_lives():
    device, host = filled(5, 3), filled(3, 4)
    space = SourceSegments([pool_bytes(device), pool_bytes(host)])
    sources = [(0, 3), (0, 4), (1, 0), (1, 1), (0, 1)]  # a device run, then the host tier, then device again
    addresses = [space.address(s, b) for s, b in sources]
    expected = np.concatenate([np.concatenate([pool_bytes(device if s == 0 else host)[1, kv, b].reshape(-1)
                                               for s, b in sources]) for kv in (0, 1)])
    assert chunk_checksum(space, 1, addresses) == checksum_views([expected])
    out = np.empty(chunk_nbytes(space, len(addresses)), dtype=np.uint8)
    gather_chunk(space, 1, addresses, out)
    assert np.array_equal(out, expected)
    dst = KvPool(ABI, 10)
    landing = [9, 2, 3, 4, 0]
    digest = copy_and_checksum(space, addresses, pool_bytes(dst), landing, 1)
    assert digest == chunk_checksum(space, 1, addresses)
    for (s, b), d in zip(sources, landing):
        assert torch.equal(dst.tensor[1, :, d], (device if s == 0 else host).tensor[1, :, b])
    assert sum(v.size for v in chunk_views(space, 1, addresses)) == out.size
