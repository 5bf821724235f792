"""Which leading prefix of a request each worker of a pool can already see.

Workers report the set of prefix-block hashes they hold. Hashes form a chain over full 16-token
blocks (each block's hash covers its parent's), so a request's reusable prefix at a worker is the
longest run of its block hashes, from the first, that the worker holds; a held block after a miss
is useless because its parent's K/V is absent.

The index inverts the reports into a bool matrix: block hash -> row, `held[row, slot]` true when
the slot holds that block. Row 0 is a sentinel that no slot holds (and that no hash maps to). A
lookup maps the request's hashes to rows up to the first hash nobody holds, appends the sentinel,
gathers those rows and takes, per slot, the first row it lacks: that index is the slot's leading
hit. O(len(hashes)) dictionary probes plus two vector operations over a [hits + 1, slots] block,
whatever the pool size. `replace_slot` patches one column in place (only the difference of the
two held sets is touched) and `patch_slot` applies a change given as additions and removals
(the cluster K/V index's block events, router/kv/kv_index.py); rows nobody holds any more are
recycled. A patch writes single bytes: the matrix is a numpy view over a `bytearray`, patched by
index in plain Python (no array is built per patch), with a holder count per row to know when a
row falls free. Memory: one byte per (held hash, slot), plus the counts (`memory_bytes`).

The router keeps one matrix for all its pools (`WorkerPrefixes`): a column per worker id, kept
across the worker's epochs, role moves and absences, so a membership change moves no matrix byte;
a pool reads it through a `SlotView`, its slots' columns (`cols`), the kernels indexing through
them. A restart costs only its held-set change (the old epoch's removals, the new one's stores).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

import numpy as np

from pdserve.router import kernels

_SENTINEL = 0  # the row no slot holds


class PrefixIndex:
    __slots__ = ("rows", "held", "num_slots", "_free", "_bytes", "_holders", "_identity")

    def __init__(self, num_slots: int, capacity: int = 64):
        self.rows: dict[int, int] = {}  # block hash -> row of `held` (never the sentinel)
        self._bytes = bytearray((capacity + 1) * num_slots)  # row-major: held[row, slot] is byte row * slots + slot
        self.held = np.frombuffer(self._bytes, dtype=bool).reshape(capacity + 1, num_slots)  # [rows, slots]
        self._holders = [0] * (capacity + 1)  # per row: how many slots hold it
        self.num_slots = num_slots
        self._free = list(range(capacity, 0, -1))  # unused rows, popped from the end (lowest first)
        self._identity = np.arange(num_slots, dtype=np.int64)  # column of each slot when read directly

    @classmethod
    def build(cls, held_sets: Sequence[Iterable[int]]) -> PrefixIndex:
        sets = [frozenset(held) for held in held_sets]
        index = cls(len(sets), capacity=len(frozenset().union(*sets)))
        for slot, held in enumerate(sets):
            index.replace_slot(slot, frozenset(), held)
        return index

    @property
    def owners(self) -> dict[int, int]:
        """Block hash -> bitmask over slots (a canonical view for tests and debugging)."""
        weights = [1 << slot for slot in range(self.num_slots)]
        return {h: sum(w for w, bit in zip(weights, self.held[row].tolist()) if bit) for h, row in self.rows.items()}

    def replace_slot(self, slot: int, old: frozenset[int], new: frozenset[int]) -> None:
        """Patch one slot's held set in place (only the difference is touched)."""
        self.patch_slot(slot, new - old, old - new)

    def patch_slot(self, slot: int, added: Iterable[int], removed: Iterable[int]) -> None:
        """One slot gained `added` and lost `removed` (a held-set change, router/kv/kv_index.py)."""
        rows, flat, holders, width = self.rows, self._bytes, self._holders, self.num_slots
        for block_hash in removed:
            row = rows.get(block_hash)
            if row is not None and flat[row * width + slot]:
                flat[row * width + slot] = 0
                holders[row] -= 1
                if not holders[row]:  # nobody holds it any more: recycle the (now all-false) row
                    del rows[block_hash]
                    self._free.append(row)
        for block_hash in added:
            row = rows.get(block_hash)
            if row is None:
                row = self._new_row(block_hash)
                flat = self._bytes  # `_new_row` may have grown the matrix
            if not flat[row * width + slot]:
                flat[row * width + slot] = 1
                holders[row] += 1

    def widen(self, num_slots: int) -> None:
        """Room for `num_slots` columns (the new ones empty): one copy of the matrix."""
        if num_slots <= self.num_slots:
            return
        rows, old = len(self._holders), self.num_slots
        grown = bytearray(rows * num_slots)
        held = np.frombuffer(grown, dtype=bool).reshape(rows, num_slots)  # [rows, slots]
        held[:, :old] = self.held
        self._bytes, self.held, self.num_slots = grown, held, num_slots
        self._identity = np.arange(num_slots, dtype=np.int64)

    def memory_bytes(self) -> int:
        """The matrix, its holder counts and the hash -> row map (CPython sizes: a list slot and a
        dict entry with its int key and row)."""
        return len(self._bytes) + 8 * len(self._holders) + _BYTES_PER_ROW_KEY * len(self.rows)

    def _new_row(self, block_hash: int) -> int:
        if not self._free:
            self._grow()
        row = self.rows[block_hash] = self._free.pop()
        return row

    def _grow(self) -> None:
        old = len(self._holders)
        grown = bytearray(2 * old * self.num_slots)
        grown[: len(self._bytes)] = self._bytes
        self._bytes, self.held = grown, np.frombuffer(grown, dtype=bool).reshape(2 * old, self.num_slots)  # [rows, slots]
        self._holders.extend([0] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def leading_rows(self, block_hashes: Sequence[int]) -> list[int]:
        """Rows of the request's leading hashes that some slot holds (stops at the first that none does)."""
        get, rows = self.rows.get, []
        for block_hash in block_hashes:
            row = get(block_hash)
            if row is None:
                break
            rows.append(row)
        return rows

    def hits_for_rows(self, rows: list[int]) -> np.ndarray:
        """Per slot, how many of `rows` (from `leading_rows`, which this extends with the sentinel)
        it holds before its first miss. Shape [num_slots], int64."""
        rows.append(_SENTINEL)  # every slot misses by then
        window = self.held.take(rows, axis=0)  # [len(rows), slots]
        first_miss = np.ascontiguousarray(window.T).argmin(axis=1)  # [slots]: argmin along contiguous rows
        return first_miss.astype(np.int64, copy=False)

    def lookup(self, block_hashes: Sequence[int]) -> np.ndarray | None:
        """Per slot, how many leading blocks of `block_hashes` it holds (shape [num_slots], int64),
        or None when no slot holds the first block. With the compiled kernels the hashes are
        probed in C (`map`) in chunks, a miss reading as the sentinel row, which no slot holds,
        so the kernel's count stops there; otherwise the numpy path above."""
        if not block_hashes:
            return None
        if not kernels.enabled:
            rows = self.leading_rows(block_hashes)
            return self.hits_for_rows(rows) if rows else None
        rows = self.probe(block_hashes)
        return None if rows is None else kernels.leading_counts(rows, self.held, self._identity)

    def probe(self, block_hashes: Sequence[int]) -> np.ndarray | None:
        """The rows the compiled kernels read for a non-empty request (the sentinel where nobody
        holds a hash; at least up to the first such), or None when no slot holds the first block."""
        rows = _probe(self.rows.get, block_hashes)
        return None if rows[0] == _SENTINEL else rows

    def leading_hits(self, block_hashes: Sequence[int]) -> np.ndarray:
        """Per slot, how many leading blocks of `block_hashes` it holds. Shape [num_slots], int64."""
        hits = self.lookup(block_hashes) if block_hashes else None
        return np.zeros(self.num_slots, dtype=np.int64) if hits is None else hits


_BYTES_PER_ROW_KEY = 100  # a dict entry (~40 with its share of the table) and its int key and row (~60)


class SlotView:
    """A pool's slots over a shared matrix: slot i reads column `cols[i]`. The snapshot's
    `prefix`; the same lookups as `PrefixIndex`, per slot."""

    __slots__ = ("index", "cols", "num_slots")

    def __init__(self, index: PrefixIndex, cols: np.ndarray):
        self.index, self.cols, self.num_slots = index, cols, len(cols)  # cols: [slots] int64

    @property
    def held(self) -> np.ndarray:
        return self.index.held  # [rows, columns]: index it through `cols`

    @property
    def owners(self) -> dict[int, int]:
        """Block hash -> bitmask over this view's slots (held by at least one of them)."""
        index, cols = self.index, self.cols.tolist()
        owners = {}
        for block_hash, row in index.rows.items():
            bits = index.held[row].tolist()
            mask = sum(1 << slot for slot, col in enumerate(cols) if bits[col])
            if mask:
                owners[block_hash] = mask
        return owners

    def probe(self, block_hashes: Sequence[int]) -> np.ndarray | None:
        return self.index.probe(block_hashes)

    def lookup(self, block_hashes: Sequence[int]) -> np.ndarray | None:
        """Per slot, how many leading blocks it holds ([slots], int64); None when nobody holds the
        first block (or no slot of this view holds any of the request's blocks: all zero)."""
        if not block_hashes:
            return None
        if kernels.enabled:
            rows = self.index.probe(block_hashes)
            return None if rows is None else kernels.leading_counts(rows, self.index.held, self.cols)
        rows = self.index.leading_rows(block_hashes)
        if not rows:
            return None
        rows.append(_SENTINEL)
        window = self.index.held.take(rows, axis=0).take(self.cols, axis=1)  # [len(rows), slots]
        return np.ascontiguousarray(window.T).argmin(axis=1).astype(np.int64, copy=False)

    def leading_hits(self, block_hashes: Sequence[int]) -> np.ndarray:
        hits = self.lookup(block_hashes)
        return np.zeros(self.num_slots, dtype=np.int64) if hits is None else hits


class WorkerPrefixes:
    """The router's one prefix matrix: a column per worker id, patched once per held-set change
    (router/kv/kv_index.py's `HeldChange`s), read by every pool through a `SlotView`."""

    def __init__(self, capacity: int = 16):
        self.index = PrefixIndex(capacity)
        self.columns: dict[str, int] = {}

    def column(self, worker_id: str) -> int:
        col = self.columns.get(worker_id)
        if col is None:
            col = self.columns[worker_id] = len(self.columns)
            if col >= self.index.num_slots:
                self.index.widen(2 * self.index.num_slots)
        return col

    def patch(self, worker_id: str, added: Iterable[int], removed: Iterable[int]) -> None:
        self.index.patch_slot(self.column(worker_id), added, removed)

    def view(self, worker_ids: Sequence[str]) -> SlotView:
        return SlotView(self.index, np.array([self.column(w) for w in worker_ids], dtype=np.int64))

    def memory_bytes(self) -> int:
        return self.index.memory_bytes()


_PROBE_CHUNK = 128  # hashes probed per C-level pass; a long prompt stops after the chunk that misses


def _probe(get: Callable[..., int], block_hashes: Sequence[int]) -> np.ndarray:
    """Rows of `block_hashes` (the sentinel where nobody holds one), at least up to the first miss.
    Shape [<= len(block_hashes)], int64."""
    if len(block_hashes) <= _PROBE_CHUNK:
        return np.fromiter(map(get, block_hashes, repeat(_SENTINEL)), np.int64, len(block_hashes))
    rows: list[int] = []
    for start in range(0, len(block_hashes), _PROBE_CHUNK):
        chunk = list(map(get, block_hashes[start : start + _PROBE_CHUNK], repeat(_SENTINEL)))
        rows += chunk
        if _SENTINEL in chunk:
            break
    return np.array(rows, dtype=np.int64)


def leading_hit_blocks(block_hashes: Sequence[int], held: frozenset[int]) -> int:
    """Reference for one worker: the length of the leading run of `block_hashes` in `held`."""
    count = 0
    for block_hash in block_hashes:
        if block_hash not in held:
            break
        count += 1
    return count
