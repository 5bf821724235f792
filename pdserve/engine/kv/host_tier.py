"""The host-memory tier of one engine's prefix cache (issue 19, part 4).

Contract: a second, larger K/V pool in host memory (`--host-kv-mb`) for blocks the device pool's
prefix cache evicts. `demote(hash, tokens, block)` copies an evicted device block's K/V into a
host slot (the least recently used unpinned host block goes first when the tier is full; its hash
is returned so the caller records it REMOVED; with every used slot pinned the demoted block itself
is dropped and its own hash returned); `find(hash, tokens)` says whether the tier holds that exact
block (hash and token ids) and makes it the most recent; `promote(hash, block)` copies it into a
device block and drops it here (a hit moves the block back; it lives in one tier at a time).
The pool lives in a named shared-memory segment when the device pool does (`<device name>-host`,
owner-only like the device pool), so a same-host peer's prefix fetch reads host slots in place
(workers/prefix_fetch/fetch_holder.py). Pins: `pin(hash, tokens)` returns the block's slot and holds it for a
fetch until `unpin(slot)`. A pinned slot is never the LRU victim and never reused: a promotion or
`discard` of a pinned block drops its hash from the tier as usual but parks the slot in `draining`
until its last pin drops, so bytes a peer is reading never change under it. Every slot is free,
used (holds one block) or draining: `check()` proves it. The device pool and this pool share the
K/V ABI, so a copy is one [L, 2] slab per block, bitwise.
Capacity, use, pins, hits (blocks promoted), in-place reads, demotions and evictions are counted
for the worker's load report (`/workers`, `pdserve_kv_tier_blocks`). The copy rate is measured for
the router's cost model (router/pricing/kv_rates.py: a host-tier hit is priced at its promotion):
`copy_bytes` and `copy_s` sum a calibration at start (`CALIBRATION_BLOCKS` device -> free host
slot copies, which change nothing, timed on a second pass: the first one maps fresh pages, a
one-off cost that would price every later promotion ~1,000x too high) and then every promotion's
own copy.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

from pdserve.engine.kv.kv_pool import KvPool

CALIBRATION_BLOCKS = 8


class HostTier:
    def __init__(self, device: KvPool, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.device = device
        shm = f"{device.shm_name}-host" if device.shm_name else None  # shared when the device pool is
        self.pool = KvPool(device.abi, num_blocks, shm_name=shm)  # host memory, the device pool's layout
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens); LRU first
        self.pins: Counter[int] = Counter()  # slot -> live fetch pins
        self.draining: set[int] = set()  # slots whose block left the tier while pinned: freed at the last unpin
        self.num_hits = 0
        self.num_demotions = 0
        self.num_evictions = 0
        self.num_inplace_reads = 0  # blocks a peer's fetch read from a pinned slot (no promotion)
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

    @property
    def shm_name(self) -> str | None:
        return self.pool.shm_name

    @property
    def num_pinned(self) -> int:
        return len(self.pins)

    def _copy(self, dst: KvPool, dst_block: int, src: KvPool, src_block: int) -> None:
        dst.tensor[:, :, dst_block].copy_(src.tensor[:, :, src_block])  # [L, 2, B, H, D]: one block, every layer

    def _timed_copy(self, dst: KvPool, dst_block: int, src: KvPool, src_block: int) -> None:
        t0 = time.perf_counter()
        self._copy(dst, dst_block, src, src_block)
        self.copy_s += time.perf_counter() - t0
        self.copy_bytes += self.block_bytes

    def _victim(self) -> bytes | None:
        """The least recent block whose slot no fetch pins."""
        return next((h for h, (slot, _) in self.lru.items() if slot not in self.pins), None)

    def demote(self, block_hash: bytes, tokens: tuple[int, ...], block: int) -> bytes | None:
        """Keep an evicted device block here; returns the hash this evicted from the tier, if any
        (`block_hash` itself when every used slot is pinned: the block passed through)."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return None
        evicted = None
        if not self.free:
            evicted = self._victim()
            if evicted is None:
                return block_hash
            self.free.append(self.lru.pop(evicted)[0])
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

    def _release_slot(self, slot: int) -> None:
        if slot in self.pins:
            self.draining.add(slot)
        else:
            self.free.append(slot)

    def promote(self, block_hash: bytes, block: int) -> None:
        """Copy the block into device block `block` and drop it here (it lives in one tier)."""
        slot, _ = self.lru.pop(block_hash)
        self._timed_copy(self.device, block, self.pool, slot)
        self._release_slot(slot)
        self.num_hits += 1

    def discard(self, block_hash: bytes) -> bool:
        """The device cached this hash again (recomputed): one tier holds a block at a time.
        True when the tier held it (the caller records its removal from here)."""
        entry = self.lru.pop(block_hash, None)
        if entry is not None:
            self._release_slot(entry[0])
        return entry is not None

    def pin(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """Hold the exact block's slot for a fetch that reads it in place; None: not here."""
        if not self.find(block_hash, tokens):
            return None
        slot = self.lru[block_hash][0]
        self.pins[slot] += 1
        return slot

    def unpin(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise AssertionError(f"host slot {slot} is not pinned")
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            del self.pins[slot]
            if slot in self.draining:
                self.draining.discard(slot)
                self.free.append(slot)

    def check(self) -> None:
        used = [slot for slot, _ in self.lru.values()]
        places = [set(used), set(self.free), self.draining]
        overlap = any(a & b for i, a in enumerate(places) for b in places[i + 1:])
        if len(set(used)) != len(used) or overlap or len(used) + len(self.free) + len(self.draining) != self.num_blocks:
            raise AssertionError(f"host tier: {len(used)} used + {len(self.free)} free + {len(self.draining)} draining "
                                 f"!= {self.num_blocks}")
        if not set(self.pins) <= set(used) | self.draining or not self.draining <= set(self.pins):
            raise AssertionError(f"host tier: pins {dict(self.pins)} vs draining {sorted(self.draining)}")

    def assert_no_pins(self) -> None:
        assert not self.pins and not self.draining, f"host slots pinned: {dict(self.pins)}"

    def close(self) -> None:
        self.pool.close(unlink=self.pool.shm_name is not None)
