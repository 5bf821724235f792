"""Shard layouts of K/V across tensor-parallel ranks, and the head-to-rank map of a handoff.

Contract: the K/V ABI (engine/kv/kv_abi.py) and its digest describe the LOGICAL pool
[L, 2, N, B, H_kv, D], whatever the worker's tensor-parallel size; a pool shared by TP ranks keeps
that byte layout and rank r reads and writes only K/V heads [r * H_kv/tp, (r + 1) * H_kv/tp)
(engine/tp_group.py). So two workers of different TP sizes pass each other's identity fence, and
a chunk's bytes, checksums and manifest are the same as between two TP 1 workers. The source's
layout travels beside the ABI in the manifest (`HandoffManifest.shards`); the destination refuses
one that does not tile the ABI's heads. `head_moves` is the transfer plan's head map: logical head
h leaves the source rank that wrote it and lands in the bytes the destination's owner rank reads
(the same logical offset, h * D * dtype_bytes within each token row).
"""

from __future__ import annotations

import msgspec

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.handoff.errors import HandoffError, RejectReason


class ShardLayout(msgspec.Struct, frozen=True):
    """How a worker's K/V heads are split over its tensor-parallel ranks (equal contiguous runs)."""

    tp: int = 1

    def heads_per_rank(self, abi: KvAbi) -> int:
        return abi.num_kv_heads // self.tp

    def owner(self, abi: KvAbi, head: int) -> int:
        """The rank that writes (source) or reads (destination) logical K/V head `head`."""
        if not 0 <= head < abi.num_kv_heads:
            raise ValueError(f"head {head} outside 0..{abi.num_kv_heads - 1}")
        return head // self.heads_per_rank(abi)


class HeadMove(msgspec.Struct, frozen=True):
    head: int  # logical K/V head
    src_rank: int
    dst_rank: int
    row_offset: int  # bytes from the start of a token's row [H_kv, D] in both pools
    nbytes: int  # bytes of this head in one token row (D * dtype_bytes)


def check_layout(layout: ShardLayout, abi: KvAbi) -> None:
    """Raise `HandoffError(WRONG_ABI)` unless `layout` splits the ABI's K/V heads evenly."""
    if layout.tp < 1 or abi.num_kv_heads % layout.tp:
        raise HandoffError(RejectReason.WRONG_ABI, f"TP {layout.tp} shards do not tile {abi.num_kv_heads} K/V heads")


def head_moves(src: ShardLayout, dst: ShardLayout, abi: KvAbi) -> tuple[HeadMove, ...]:
    """Every logical K/V head with the rank that produced it and the rank that will read it."""
    check_layout(src, abi)
    check_layout(dst, abi)
    width = abi.head_dim * abi.dtype_bytes
    return tuple(HeadMove(h, src.owner(abi, h), dst.owner(abi, h), h * width, width) for h in range(abi.num_kv_heads))


def layout_of(pool) -> ShardLayout:
    """The layout of an engine's pool (`KvPool.tp`, 1 when it has none)."""
    return ShardLayout(tp=getattr(pool, "tp", 1))
