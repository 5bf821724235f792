"""Block accounting for one K/V pool: free list, reference counts, prefix cache, reservations.

Contract:
- Every block is in exactly one place: the free list, the evictable LRU (cached, refcount 0),
  or in use (refcount > 0). `check_integrity()` proves it, and that refcounts equal the number
  of block-table references the caller reports.
- Mutations come in check-then-act pairs: `can_allocate` / `allocate`, `can_reserve` / `reserve`.
  Acting without capacity raises `OutOfBlocks`; nothing is half-done.
- Prefix cache: a full block's identity is the chain hash h_j = H(I || h_{j-1} || tokens_j), with I
  the model + K/V ABI identity. A hit re-checks the stored token ids. Shared blocks are
  reference-counted; unreferenced cached blocks stay reusable until evicted, least recent first.
- Reservations hold capacity (not specific blocks) for an owner, e.g. a handoff destination's
  expected decode growth; `can_allocate` for everyone else leaves reserved capacity untouched.
- Never-used blocks are handed out first, in ascending order (the free list starts as 0..N-1 and
  freed blocks join its back), so the blocks ever handed out are [0, high_water); `on_grow`, when
  set, hears each new high-water mark before the blocks are returned (the engine's pool makes their
  pages resident then: kv_pool.py "on_use").
- Every change of the prefix cache's key set is recorded, numbered, in `events` (kv_events.py):
  STORED when `register` caches a hash, REMOVED when eviction uncaches it; `kv_report` hands
  them out (or the whole key set as a resync) for the worker's heartbeat.
- Host tier (host_tier.py, optional): an evicted cached block is demoted there instead of
  forgotten (DEMOTED; the tier's own LRU victim REMOVED from it); `acquire_prefix` continues a
  device hit with the blocks the tier holds, each promoted into a freshly allocated device block
  (PROMOTED; allocated like a computed block, the owner's reservation first), stopping at the
  first miss or when no block can be allocated.
- The root I of the hash chain is `root_hash(identity, tenant)`: the engine passes its
  `CacheIdentity.identity_hash`, which covers the model and the K/V ABI digest (kv_abi.py), so
  two pools share a block hash only if their K/V bytes mean the same. Each request's tenant
  (`SamplingParams.tenant`: an API key's tenant or a `cache_salt`) picks its own root
  (`root_for`), so K/V is never reused across tenants; the default tenant keeps the plain root.
  Computed roots are kept in an LRU of at most `max_tenant_roots` tenants (the default tenant
  always): a client sending a new `cache_salt` per request grows nothing past it, and a root
  evicted from it is simply computed again (it is a pure function of the identity and tenant).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

from pdserve.engine.errors import OutOfBlocks, PoolIntegrityError
from pdserve.engine.kv.kv_events import BlockEventKind, BlockEventLog, KvReport, KvTier
from pdserve.engine.kv.vllm_events import HOST_MEDIUM

DEFAULT_TENANT = "default"
DEFAULT_MAX_TENANT_ROOTS = 1024  # tenants whose chain root a worker keeps (an LRU; serve --max-tenant-roots)


def root_hash(identity: str, tenant: str = DEFAULT_TENANT) -> bytes:
    """The chain's root I for a cache identity (model + K/V ABI) and a tenant."""
    salt = b"" if tenant == DEFAULT_TENANT else b"|tenant=" + tenant.encode()
    return hashlib.blake2b(b"pdserve-prefix-root|" + identity.encode() + salt, digest_size=16).digest()


def chain_hash(identity: bytes, parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """h_j = H(I || h_{j-1} || tokens of block j)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(identity)
    h.update(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def prompt_block_hashes(identity: bytes, tokens: list[int] | tuple[int, ...], block_size: int) -> list[bytes]:
    """Chain hashes of every full block of `tokens` (a trailing partial block has none)."""
    hashes, parent = [], identity
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(identity, parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, identity: str, enable_prefix_cache: bool = True,
                 max_tenant_roots: int = DEFAULT_MAX_TENANT_ROOTS):
        if max_tenant_roots < 1:
            raise ValueError(f"max_tenant_roots must be at least 1, got {max_tenant_roots}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.identity = root_hash(identity)
        self._identity_name = identity
        self._roots: OrderedDict[str, bytes] = OrderedDict()  # tenant -> chain root, least recently used first
        self.max_tenant_roots = max_tenant_roots
        self.enable_prefix_cache = enable_prefix_cache
        self.refcount = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.high_water = 0  # blocks [0, high_water) have been handed out at least once
        self.on_grow: Callable[[int], None] | None = None  # told each new high_water (KvPool.populate)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.cached: dict[bytes, int] = {}  # chain hash -> block
        self.block_key: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (hash, token ids)
        self.reserved: dict[str, int] = {}
        self.num_prefix_hits = 0
        self.num_evictions = 0
        self.events = BlockEventLog()  # numbered changes of `cached`'s key set (kv_events.py)
        self.vllm_events = None  # engine/kv/vllm_events.VllmEventSink when a worker publishes vLLM's KV events
        self.host = None  # a HostTier (host_tier.py) the engine attaches with --host-kv-mb; None: evictions forget

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free + evictable), before reservations."""
        return len(self.free) + len(self.evictable)

    @property
    def num_reserved(self) -> int:
        return sum(self.reserved.values())

    def available_for(self, owner: str | None = None) -> int:
        mine = self.reserved.get(owner, 0) if owner is not None else 0
        return self.num_free - (self.num_reserved - mine)

    def can_allocate(self, n: int, owner: str | None = None) -> bool:
        return n <= self.available_for(owner)

    def allocate(self, n: int, owner: str | None = None) -> list[int]:
        """Take n blocks (refcount 1). An owner's own reservation is consumed first."""
        if not self.can_allocate(n, owner):
            raise OutOfBlocks(f"need {n} blocks, {self.available_for(owner)} available")
        if owner is not None and owner in self.reserved:
            self.reserved[owner] = max(0, self.reserved[owner] - n)
        blocks = [self._take_one() for _ in range(n)]
        top = max(blocks, default=-1) + 1
        if top > self.high_water:
            self.high_water = top
            if self.on_grow is not None:
                self.on_grow(top)
        return blocks

    def _take_one(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._uncache(block)
            self.num_evictions += 1
        self.refcount[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks go to LRU or free list."""
        for block in blocks:
            if self.refcount[block] <= 0:
                raise PoolIntegrityError(f"block {block} released with refcount {self.refcount[block]}")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block in self.block_key:
                    self.evictable[block] = None
                else:
                    self.free.append(block)

    def share(self, blocks: list[int]) -> None:
        """Take one more reference on blocks already in use (a forked sequence reads them too)."""
        for block in blocks:
            if self.refcount[block] <= 0:
                raise PoolIntegrityError(f"block {block} shared with refcount {self.refcount[block]}")
        for block in blocks:
            self.refcount[block] += 1

    # ---- reservations ---------------------------------------------------------------------
    def can_reserve(self, n: int) -> bool:
        return n <= self.num_free - self.num_reserved

    def reserve(self, owner: str, n: int) -> None:
        if owner in self.reserved:
            raise PoolIntegrityError(f"owner {owner} already holds a reservation")
        if not self.can_reserve(n):
            raise OutOfBlocks(f"cannot reserve {n} blocks, {self.num_free - self.num_reserved} unreserved")
        self.reserved[owner] = n

    def release_reservation(self, owner: str) -> None:
        self.reserved.pop(owner, None)

    # ---- prefix cache ---------------------------------------------------------------------
    def root_for(self, tenant: str = DEFAULT_TENANT) -> bytes:
        """The chain root of `tenant`'s blocks: tenants never share a block hash, so never a hit."""
        if tenant == DEFAULT_TENANT:
            return self.identity
        roots = self._roots
        root = roots.get(tenant)
        if root is None:
            root = roots[tenant] = root_hash(self._identity_name, tenant)
            if len(roots) > self.max_tenant_roots:
                roots.popitem(last=False)
        else:
            roots.move_to_end(tenant)
        return root

    @property
    def num_tenant_roots(self) -> int:
        """Tenants whose chain root is kept (at most `max_tenant_roots`; the default's is apart)."""
        return len(self._roots)

    def hashes_for(self, tokens: list[int] | tuple[int, ...], tenant: str = DEFAULT_TENANT) -> list[bytes]:
        return prompt_block_hashes(self.root_for(tenant), tokens, self.block_size)

    def match_prefix(self, hashes: list[bytes], tokens: list[int] | tuple[int, ...]) -> int:
        """Number of leading blocks cached with these exact hashes and token ids (no side effects)."""
        if not self.enable_prefix_cache:
            return 0
        n = 0
        for j, h in enumerate(hashes):
            block = self.cached.get(h)
            if block is None or self.block_key[block][1] != tuple(tokens[j * self.block_size : (j + 1) * self.block_size]):
                break
            n += 1
        return n

    def acquire_prefix(self, hashes: list[bytes], tokens: list[int] | tuple[int, ...], limit: int,
                       owner: str | None = None) -> list[int]:
        """Take a reference on up to `limit` leading cached blocks; returns their ids. A revived
        (evictable) block leaves the free count, so it comes out of `owner`'s reservation, as an
        allocation would: reservations never come to exceed what is free."""
        n = min(self.match_prefix(hashes, tokens), limit)
        blocks = [self.cached[h] for h in hashes[:n]]
        for block in blocks:
            if self.refcount[block] == 0:
                del self.evictable[block]
                if self.reserved.get(owner, 0) > 0:
                    self.reserved[owner] -= 1
            self.refcount[block] += 1
        if self.host is not None and n < limit and self.enable_prefix_cache:
            blocks += self._promote(hashes, tokens, n, limit, owner)
        self.num_prefix_hits += len(blocks)
        return blocks

    def _promote(self, hashes: list[bytes], tokens, start: int, limit: int, owner: str | None) -> list[int]:
        """Blocks `start..` the host tier holds, each copied into a new device block (referenced,
        cached again), until the first miss, a hash the device already caches, or no room."""
        bs, out = self.block_size, []
        for j in range(start, limit):
            h, ids = hashes[j], tuple(tokens[j * bs : (j + 1) * bs])
            if h in self.cached or not self.host.find(h, ids) or not self.can_allocate(1, owner):
                break
            block = self.allocate(1, owner)[0]  # may demote another block; this one is the tier's most recent
            if not self.host.find(h, ids):  # a one-block tier gave it up to that demotion
                self.release([block])
                break
            self.host.promote(h, block)
            self.cached[h] = block
            self.block_key[block] = (h, ids)
            self.events.record(BlockEventKind.PROMOTED, h, KvTier.DEVICE)
            if self.vllm_events is not None:
                self.vllm_events.promoted(h)
            out.append(block)
        return out

    def register(self, block: int, block_hash: bytes, tokens: tuple[int, ...], parent: bytes | None = None) -> None:
        """Publish a full, computed block to the prefix cache (first writer wins); `parent`: the
        chain hash of the block before it (None for a chain's first), for vLLM-shaped events."""
        if not self.enable_prefix_cache or block_hash in self.cached or block in self.block_key:
            return
        self.cached[block_hash] = block
        self.block_key[block] = (block_hash, tokens)
        sink = self.vllm_events
        if self.host is not None and self.host.discard(block_hash) and sink is not None:
            sink.removed(block_hash, HOST_MEDIUM)  # the router's index reads the STORED below as the move
        self.events.record(BlockEventKind.STORED, block_hash)
        if sink is not None:
            sink.stored(block_hash, parent, tokens)

    def _uncache(self, block: int) -> None:
        key = self.block_key.pop(block, None)
        if key is not None and self.cached.get(key[0]) == block:
            del self.cached[key[0]]
            sink = self.vllm_events
            if self.host is None:
                self.events.record(BlockEventKind.REMOVED, key[0])
                if sink is not None:
                    sink.removed(key[0])
                return
            evicted = self.host.demote(key[0], key[1], block)  # the block's bytes are still intact here
            self.events.record(BlockEventKind.DEMOTED, key[0], KvTier.HOST)
            if sink is not None:
                sink.demoted(key[0])
            if evicted is not None:
                self.events.record(BlockEventKind.REMOVED, evicted, KvTier.HOST)
                if sink is not None:
                    sink.removed(evicted, HOST_MEDIUM)

    def cached_hashes(self) -> set[bytes]:
        return set(self.cached)

    def kv_report(self, resync: bool = False) -> KvReport:
        """The prefix cache's events since the previous report, or (asked, or more than the
        log holds) the whole key set as a resync."""
        return self.events.take(self.cached, resync, self.host.lru.keys() if self.host is not None else ())

    # ---- integrity ------------------------------------------------------------------------
    def check_integrity(self, tables: list[list[int]] | None = None) -> None:
        """free + evictable + in-use == total, each block in one place, refcounts match tables."""
        free, lru = set(self.free), set(self.evictable)
        used = {b for b in range(self.num_blocks) if self.refcount[b] > 0}
        problems = []
        if len(free) != len(self.free):
            problems.append("duplicate block in free list")
        if free & lru or free & used or lru & used:
            problems.append("block in two places")
        if len(free) + len(lru) + len(used) != self.num_blocks:
            problems.append(f"free {len(free)} + evictable {len(lru)} + used {len(used)} != {self.num_blocks}")
        if any(b not in self.block_key for b in lru):
            problems.append("uncached block in evictable list")
        if self.num_reserved > self.num_free:
            problems.append("reservations exceed free capacity")
        if self.host is not None:
            self.host.check()
        if tables is not None:
            counts = [0] * self.num_blocks
            for table in tables:
                for b in table:
                    counts[b] += 1
            if counts != self.refcount:
                problems.append("refcounts do not match block tables")
        if problems:
            raise PoolIntegrityError("; ".join(problems))

    def assert_baseline(self) -> None:
        """Nothing referenced and nothing reserved: every block is free or evictable."""
        self.check_integrity([])
        if self.reserved:
            raise PoolIntegrityError(f"reservations outstanding: {self.reserved}")
