"""The host-memory tier of one engine's prefix cache (issue 19, part 4).

Contract: a second, larger K/V pool in host memory (`--host-kv-mb`) for blocks the device pool's
prefix cache evicts. `demote(hash, tokens, block)` copies an evicted device block's K/V into a
host slot (the least recently used host block goes first when the tier is full; its hash is
returned so the caller records it REMOVED); `find(hash, tokens)` says whether the tier holds that
exact block (hash and token ids) and makes it the most recent; `promote(hash, block)` copies it
into a device block and frees its slot (a hit moves the block back; it lives in one tier at a
time). Slots are either free or hold exactly one block: `check()` proves it. The device pool and
this pool share the K/V ABI, so a copy is one [L, 2] slab per block, bitwise.
Capacity, use, hits (blocks promoted), demotions and evictions are counted for the worker's load
report (`/workers`, `pdserve_kv_tier_blocks`). The copy rate is measured for the router's cost
model (router/kv_rates.py: a host-tier hit is priced at its promotion): `copy_bytes` and `copy_s`
sum a calibration at start (`CALIBRATION_BLOCKS` device -> free host slot copies, which change
nothing, timed on a second pass: the first one maps fresh pages, a one-off cost that would price
every later promotion ~1,000x too high) and then every promotion's own copy.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from pdserve.engine.kv_pool import KvPool

CALIBRATION_BLOCKS = 8


class HostTier:
    def __init__(self, device: KvPool, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.device = device
        self.pool = KvPool(device.abi, num_blocks)  # host memory, the device pool's layout
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens); LRU first
        self.num_hits = 0
        self.num_demotions = 0
        self.num_evictions = 0
        self.block_bytes = device.abi.bytes_per_block
        self.copy_bytes, self.copy_s = 0, 0.0
        slots = range(min(CALIBRATION_BLOCKS, num_blocks))  # free slots: the copies change nothing
        for slot in slots:  # untimed: the first write maps the slot's pages (and warms torch's copy path)
            self._copy(self.pool, slot, self.device, 0)
        for slot in slots:
            self._timed_copy(self.pool, slot, self.device, 0)

    @property
    def num_used(self) -> int:
        return len(self.lru)

    def _copy(self, dst: KvPool, dst_block: int, src: KvPool, src_block: int) -> None:
        dst.tensor[:, :, dst_block].copy_(src.tensor[:, :, src_block])  # [L, 2, B, H, D]: one block, every layer

    def _timed_copy(self, dst: KvPool, dst_block: int, src: KvPool, src_block: int) -> None:
        t0 = time.perf_counter()
        self._copy(dst, dst_block, src, src_block)
        self.copy_s += time.perf_counter() - t0
        self.copy_bytes += self.block_bytes

    def demote(self, block_hash: bytes, tokens: tuple[int, ...], block: int) -> bytes | None:
        """Keep an evicted device block here; returns the hash this evicted from the tier, if any."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return None
        evicted = None
        if not self.free:
            evicted, (slot, _) = self.lru.popitem(last=False)
            self.free.append(slot)
            self.num_evictions += 1
        slot = self.free.pop()
        self._copy(self.pool, slot, self.device, block)
        self.lru[block_hash] = (slot, tuple(tokens))
        self.num_demotions += 1
        return evicted

    def find(self, block_hash: bytes, tokens: tuple[int, ...]) -> bool:
        entry = self.lru.get(block_hash)
        if entry is None or entry[1] != tuple(tokens):
            return False
        self.lru.move_to_end(block_hash)
        return True

    def promote(self, block_hash: bytes, block: int) -> None:
        """Copy the block into device block `block` and drop it here (it lives in one tier)."""
        slot, _ = self.lru.pop(block_hash)
        self._timed_copy(self.device, block, self.pool, slot)
        self.free.append(slot)
        self.num_hits += 1

    def discard(self, block_hash: bytes) -> None:
        """The device cached this hash again (recomputed): one tier holds a block at a time."""
        entry = self.lru.pop(block_hash, None)
        if entry is not None:
            self.free.append(entry[0])

    def check(self) -> None:
        used = [slot for slot, _ in self.lru.values()]
        if len(set(used)) != len(used) or set(used) & set(self.free) or len(used) + len(self.free) != self.num_blocks:
            raise AssertionError(f"host tier: {len(used)} used + {len(self.free)} free != {self.num_blocks}")

    def close(self) -> None:
        self.pool.close()
