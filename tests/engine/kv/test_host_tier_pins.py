"""Host-tier pins (engine/kv/host_tier.py) on a bare two-slot tier: a pinned slot is never the LRU
victim (eviction skips it and takes it once released), a tier whose used slots are all pinned
lets a demoted block pass through, a promotion or discard of a pinned block parks its slot until
the last pin drops (the bytes a reader maps never change), and the tier's segment is shared
memory, named after the device pool's, readable by another mapping and unlinked on close (by the engine that made it, too).
`check()` runs after every step."""

from __future__ import annotations

import os
import random
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.host_tier import HostTier
from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.engine.kv.kv_pool import KvPool

ABI = KvAbi(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
H = [bytes([i]) * 16 for i in range(8)]  # block hashes
TOKENS = (1, 2, 3, 4)


@pytest.fixture
def tier():
    device = KvPool(ABI, 8, shm_name=f"pdtest-tier-{random.getrandbits(32):08x}")
    device.tensor.copy_(torch.randn(device.shape).to(torch.bfloat16))
    host = HostTier(device, 2)
    yield host
    host.check()
    host.close()
    device.close(unlink=True)


def demote(tier: HostTier, i: int) -> bytes | None:
    evicted = tier.demote(H[i], TOKENS, i)  # device block i holds "block i"
    tier.check()
    return evicted


def slot_bytes(tier: HostTier, slot: int) -> torch.Tensor:
    return tier.pool.tensor[:, :, slot].clone()


def test_eviction_skips_a_pinned_slot_and_takes_it_after_release(tier):
    demote(tier, 0), demote(tier, 1)
    slot = tier.pin(H[0], TOKENS)
    tier.find(H[1], TOKENS)  # block 0 is the least recent again (pinning made it the most recent)
    pinned = slot_bytes(tier, slot)
    assert demote(tier, 2) == H[1]  # the LRU block 0 is pinned: block 1 goes instead
    assert H[0] in tier.lru and torch.equal(slot_bytes(tier, slot), pinned)
    assert tier.pin(H[2], TOKENS) is not None
    assert demote(tier, 3) == H[3] and H[3] not in tier.lru  # every used slot pinned: block 3 passes through
    tier.unpin(slot)
    assert demote(tier, 4) == H[0]  # released: now the least recent unpinned block goes
    assert tier.num_evictions == 2 and tier.num_pinned == 1
    tier.unpin(tier.lru[H[2]][0])
    tier.assert_no_pins()


def test_promoting_or_discarding_a_pinned_block_parks_its_slot_until_unpinned(tier):
    demote(tier, 0), demote(tier, 1)
    slot = tier.pin(H[0], TOKENS)
    before = slot_bytes(tier, slot)
    tier.promote(H[0], 7)  # a local hit copies it out; the reader keeps its slot
    tier.check()
    assert torch.equal(tier.device.tensor[:, :, 7], before)
    assert H[0] not in tier.lru and tier.draining == {slot} and slot not in tier.free
    assert demote(tier, 2) == H[1]  # no free slot: the draining one is not reused
    assert torch.equal(slot_bytes(tier, slot), before)
    tier.unpin(slot)
    assert tier.draining == set() and slot in tier.free
    other = tier.pin(H[2], TOKENS)
    tier.discard(H[2])  # recomputed on the device: same parking
    assert tier.draining == {other}
    tier.unpin(other)
    tier.check()
    tier.assert_no_pins()
    with pytest.raises(AssertionError, match="not pinned"):
        tier.unpin(other)


def test_pin_needs_the_exact_block_and_pins_stack(tier):
    demote(tier, 0)
    assert tier.pin(H[0], (9, 9, 9, 9)) is None and tier.pin(H[5], TOKENS) is None
    slot = tier.pin(H[0], TOKENS)
    assert tier.pin(H[0], TOKENS) == slot and tier.pins[slot] == 2
    tier.unpin(slot)
    assert tier.num_pinned == 1
    tier.unpin(slot)
    tier.assert_no_pins()


def test_the_tier_lives_in_a_named_shared_segment_a_peer_can_map():
    device = KvPool(ABI, 8, shm_name=f"pdtest-tier-{random.getrandbits(32):08x}")
    device.tensor.copy_(torch.randn(device.shape).to(torch.bfloat16))
    tier = HostTier(device, 2)
    name = tier.shm_name
    assert name == f"{device.shm_name}-host"
    demote(tier, 3)
    slot = tier.lru[H[3]][0]
    peer = shared_memory.SharedMemory(name=name, create=False)
    try:
        view = np.ndarray(tier.pool.shape, dtype=np.int16, buffer=peer.buf)  # bf16 as raw 16-bit words
        assert np.array_equal(view[:, :, slot], device.tensor[:, :, 3].view(torch.int16).numpy())
        del view
    finally:
        peer.close()
    tier.close()
    device.close(unlink=True)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name, create=False)


def test_a_private_device_pool_keeps_a_private_tier():
    host = HostTier(KvPool(ABI, 4), 2)
    assert host.shm_name is None
    host.close()


def test_an_engine_closes_the_shared_host_tier_it_made():
    """An engine built outside a worker, on a shared pool with a host tier, leaves no segment."""
    name = f"pdtest-engine-{random.getrandbits(32):08x}"
    engine = Engine(EngineConfig(model="tiny", dtype="float32", kv_shm_name=name, num_blocks=16, host_kv_bytes=1 << 20))
    host = engine.blocks.host.shm_name
    assert host == f"{name}-host" and os.path.exists(f"/dev/shm/{host}")
    engine.close()
    engine.close()  # twice is harmless
    assert not os.path.exists(f"/dev/shm/{host}")
    engine.pool.close(unlink=True)
    assert not os.path.exists(f"/dev/shm/{name}")
