"""Bounds on what a handoff link accepts from its peer, derived from the K/V ABI and the pool size.

Contract: a peer's frame header is read into memory only when its declared length is at most
`max_header_bytes`, and a chunk's payload is landed or drained only when its declared size is at
most `max_payload_bytes`; anything larger closes the connection before a byte is allocated.
Both bounds follow from what a transfer into (or out of) this pool can ever need:
  * the largest header is a manifest (or a seal) of a transfer of every block of the pool, cut
    into one chunk per (layer, block): a fixed part (fence, identity, ABI, capability) plus a
    bounded encoding per chunk and per block;
  * the largest payload is one layer's K and V for every block of the pool.
`io_timeout_s` bounds every blocking read and write on a handoff socket: a peer that stalls in
the middle of a header or payload ends the link (`LinkClosed`) within it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv.kv_abi import KvAbi

FIXED_HEADER_BYTES = 64 << 10  # fence, identity, ABI, shard layout and capability: strings of bounded size
CHUNK_SPEC_BYTES = 256  # one encoded ChunkSpec (field names, a short chunk id, seven integers) or seal entry
BLOCK_ID_BYTES = 16  # one block id in a manifest's or grant's block list
DEFAULT_IO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LinkLimits:
    max_header_bytes: int
    max_payload_bytes: int
    io_timeout_s: float | None = DEFAULT_IO_TIMEOUT_S  # None: block forever (only for in-process benches)


def link_limits(abi: KvAbi, num_blocks: int, io_timeout_s: float | None = DEFAULT_IO_TIMEOUT_S) -> LinkLimits:
    """The bounds for links of a pool of `num_blocks` blocks with this ABI."""
    max_chunks = abi.num_layers * num_blocks  # one chunk per (layer, block) at the finest cut
    header = FIXED_HEADER_BYTES + max_chunks * CHUNK_SPEC_BYTES + num_blocks * BLOCK_ID_BYTES
    payload = 2 * num_blocks * abi.slab_bytes  # K and V of one layer, every block
    return LinkLimits(header, payload, io_timeout_s)


def io_timeout_for_lease(lease_s: float) -> float:
    """A worker's handoff socket timeout: a third of its K/V lease (so a stalled transfer is
    reported well within it), at least 1 s and at most `DEFAULT_IO_TIMEOUT_S`."""
    return max(1.0, min(DEFAULT_IO_TIMEOUT_S, lease_s / 3))


# Links built without a pool in view (benches, tools): a generous bound that still refuses a
# peer's 4 GiB header before allocating it.
UNSIZED = LinkLimits(64 << 20, 1 << 40, None)
