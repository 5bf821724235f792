"""The prefix cache's block events in vLLM's KV-events schema, so an indexer built for vLLM
(llm-d's KV-cache manager, Dynamo's KV router) can follow a pdserve worker.

Contract: the block manager calls `stored` when a full block's chain hash enters the cache,
`removed` when it leaves a tier for good (evicted from the device pool without a host tier, evicted
from the host tier, or the host tier's copy dropped because the device cached the block again), and
`demoted` / `promoted` when it moves to the host tier or back (a removal from one medium, then a
store on the other: a block lives in one tier at a time). Each call appends vLLM events (msgspec
structs, array-like and tagged by class name, as vllm.distributed.kv_events declares them) to
`pending`; `take()` hands them out as one `KVEventBatch`. Block hashes are pdserve's chain hashes
(bytes); `parent_block_hash` is None for a chain's first block; `medium` is "GPU" for the device
pool (vLLM's name for it, also on a CPU worker) and "CPU" for the host tier. A worker's first batch
starts with `AllBlocksCleared` (its cache starts empty); `snapshot()` turns the next batch into the
whole state (the publisher asks for one when a subscriber subscribes, after a batch it dropped and
from a replaced relay: workers/kv_publisher.py).
"""

from __future__ import annotations

import time

import msgspec

DEVICE_MEDIUM, HOST_MEDIUM = "GPU", "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change of the cache's block set."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class _Held(msgspec.Struct, gc=False):
    parent: bytes | None
    tokens: tuple[int, ...]
    media: set[str]  # the tiers holding the block now


class VllmEventSink:
    """Events of one block manager in vLLM's shape; remembers each held block's parent, tokens and
    tiers so a move between tiers can be told as a store there. A block is forgotten when it leaves
    its last tier, so the memory is bounded by the device pool plus the host tier."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pending: list[KVCacheEvent] = [AllBlocksCleared()]
        self._known: dict[bytes, _Held] = {}

    def _store(self, block_hash: bytes, medium: str) -> None:
        held = self._known.get(block_hash)
        if held is None:  # not seen stored (a caller's slip): told without its parent and tokens
            held = self._known[block_hash] = _Held(None, (), set())
        held.media.add(medium)
        self.pending.append(BlockStored([block_hash], held.parent, list(held.tokens), self.block_size, None, medium))

    def _remove(self, block_hash: bytes, medium: str, forget: bool = True) -> None:
        self.pending.append(BlockRemoved([block_hash], medium))
        held = self._known.get(block_hash)
        if held is not None:
            held.media.discard(medium)
            if forget and not held.media:
                del self._known[block_hash]

    def stored(self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...],
               medium: str = DEVICE_MEDIUM) -> None:
        self._known[block_hash] = _Held(parent, tuple(tokens), self._media(block_hash))
        self._store(block_hash, medium)

    def removed(self, block_hash: bytes, medium: str = DEVICE_MEDIUM) -> None:
        self._remove(block_hash, medium)

    def demoted(self, block_hash: bytes) -> None:
        self._remove(block_hash, DEVICE_MEDIUM, forget=False)
        self._store(block_hash, HOST_MEDIUM)

    def promoted(self, block_hash: bytes) -> None:
        self._remove(block_hash, HOST_MEDIUM, forget=False)
        self._store(block_hash, DEVICE_MEDIUM)

    def snapshot(self) -> None:
        """Replace what is pending by the whole state: AllBlocksCleared, then a BlockStored per
        held block and tier (for a subscriber that just joined: applied over anything, it leaves
        exactly what the tiers hold, so a subscriber that held what it had already seen ends the
        same)."""
        self.pending = [AllBlocksCleared()] + [
            BlockStored([h], held.parent, list(held.tokens), self.block_size, None, medium)
            for h, held in self._known.items() for medium in sorted(held.media, reverse=True)]

    def _media(self, block_hash: bytes) -> set[str]:
        held = self._known.get(block_hash)
        return held.media if held is not None else set()

    def held(self) -> dict[bytes, set[str]]:
        """Each block the sink remembers and the tiers its events put it in."""
        return {h: set(held.media) for h, held in self._known.items()}

    def take(self) -> KVEventBatch | None:
        if not self.pending:
            return None
        events, self.pending = self.pending, []
        return KVEventBatch(time.time(), events)
