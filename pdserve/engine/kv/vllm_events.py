"""The prefix cache's block events in vLLM's KV-events schema, so an indexer built for vLLM
(llm-d's KV-cache manager, Dynamo's KV router) can follow a pdserve worker.

Contract: the block manager calls `stored` when a full block's chain hash enters the cache,
`removed` when it leaves the device pool and `demoted` / `promoted` when the host tier takes or
returns it. Each call appends vLLM events (msgspec structs, array-like and tagged by class name, as
vllm.distributed.kv_events declares them) to `pending`; `take()` hands them out as one
`KVEventBatch`. Block hashes are pdserve's chain hashes (bytes); `parent_block_hash` is None for a
chain's first block; `medium` is "GPU" for the device pool (vLLM's name for it, also on a CPU
worker) and "CPU" for the host tier. A worker's first batch starts with `AllBlocksCleared` (its
cache starts empty), so a subscriber that joins a restarted worker drops what it held.
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


class VllmEventSink:
    """Events of one block manager in vLLM's shape; remembers each cached block's parent and
    tokens so a demotion to the host tier can be told as a store there (bounded by the cache)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pending: list[KVCacheEvent] = [AllBlocksCleared()]
        self._known: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}

    def stored(self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...], medium: str = DEVICE_MEDIUM) -> None:
        self._known[block_hash] = (parent, tokens)
        self.pending.append(BlockStored([block_hash], parent, list(tokens), self.block_size, None, medium))

    def removed(self, block_hash: bytes, medium: str = DEVICE_MEDIUM) -> None:
        self.pending.append(BlockRemoved([block_hash], medium))
        if medium == HOST_MEDIUM or block_hash not in self._known:
            self._known.pop(block_hash, None)

    def demoted(self, block_hash: bytes) -> None:
        self.pending.append(BlockRemoved([block_hash], DEVICE_MEDIUM))
        parent, tokens = self._known.get(block_hash, (None, ()))
        self.pending.append(BlockStored([block_hash], parent, list(tokens), self.block_size, None, HOST_MEDIUM))

    def promoted(self, block_hash: bytes) -> None:
        parent, tokens = self._known.get(block_hash, (None, ()))
        self.pending.append(BlockStored([block_hash], parent, list(tokens), self.block_size, None, DEVICE_MEDIUM))

    def take(self) -> KVEventBatch | None:
        if not self.pending:
            return None
        events, self.pending = self.pending, []
        return KVEventBatch(time.time(), events)
