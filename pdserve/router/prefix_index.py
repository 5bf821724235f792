"""Which leading prefix of a request each worker of a pool can already see.

Workers report the set of prefix-block hashes they hold. Hashes form a chain over full 16-token
blocks (each block's hash covers its parent's), so a request's reusable prefix at a worker is the
longest run of its block hashes, from the first, that the worker holds; a held block after a miss
is useless because its parent's K/V is absent.

The index inverts the reports once per change: block hash -> bitmask of pool slots holding it.
A lookup then walks the request's hashes once for the whole pool, narrowing the mask of workers
still matching, instead of probing every worker's set: O(len(hashes) + pool size) per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixIndex:
    owners: dict[int, int]  # block hash -> bitmask over pool slots
    num_slots: int

    @classmethod
    def build(cls, held_sets: Sequence[Iterable[int]]) -> PrefixIndex:
        owners: dict[int, int] = {}
        for slot, held in enumerate(held_sets):
            bit = 1 << slot
            for block_hash in held:
                owners[block_hash] = owners.get(block_hash, 0) | bit
        return cls(owners=owners, num_slots=len(held_sets))

    def replace_slot(self, slot: int, old: frozenset[int], new: frozenset[int]) -> None:
        """Patch one slot's held set in place (only the difference is touched)."""
        bit, owners = 1 << slot, self.owners
        for block_hash in old - new:
            mask = owners.get(block_hash, 0) & ~bit
            if mask:
                owners[block_hash] = mask
            else:
                owners.pop(block_hash, None)
        for block_hash in new - old:
            owners[block_hash] = owners.get(block_hash, 0) | bit

    def leading_hits(self, block_hashes: Sequence[int]) -> np.ndarray:
        """Per slot, how many leading blocks of `block_hashes` it holds. Shape [num_slots]."""
        num_slots = self.num_slots
        hits = [0] * num_slots
        get = self.owners.get
        alive = (1 << num_slots) - 1
        depth = 0
        for block_hash in block_hashes:
            still = alive & get(block_hash, 0)
            if still != alive:
                if depth:
                    dropped = alive ^ still  # slots that matched exactly `depth` blocks
                    while dropped:
                        low = dropped & -dropped
                        hits[low.bit_length() - 1] = depth
                        dropped ^= low
                if not still:
                    return np.array(hits, dtype=np.int64)
                alive = still
            depth += 1
        while alive:  # slots holding every block
            low = alive & -alive
            hits[low.bit_length() - 1] = depth
            alive ^= low
        return np.array(hits, dtype=np.int64)


def leading_hit_blocks(block_hashes: Sequence[int], held: frozenset[int]) -> int:
    """Reference for one worker: the length of the leading run of `block_hashes` in `held`."""
    count = 0
    for block_hash in block_hashes:
        if block_hash not in held:
            break
        count += 1
    return count
