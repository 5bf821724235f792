"""Validation before publication: is the destination's copy exactly the expected, complete cache?

Contract: `validate_landing` raises `HandoffError` with the first failing fence, checked in the
order identity -> chunk ids -> layer x token coverage -> checksums -> visibility, and returns
None when the transfer may publish. It reads only its arguments (pure).
"""

from __future__ import annotations

from collections import defaultdict

from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.manifest import HandoffManifest, IdentityFence, check_fence
from pdserve.handoff.states import ChunkState, ChunkTable


def check_coverage(manifest: HandoffManifest) -> None:
    """Per layer, chunks must tile every transferred block and token exactly once."""
    abi, prompt = manifest.abi, manifest.prompt
    by_layer: dict[int, list] = defaultdict(list)
    for spec in manifest.chunks:
        by_layer[spec.layer].append(spec)
    if sorted(by_layer) != list(range(abi.num_layers)):
        raise HandoffError(RejectReason.INCOMPLETE_COVERAGE, f"layers {sorted(by_layer)}")
    expected_tokens = prompt.num_tokens - prompt.first_token(abi.block_size)
    for layer, specs in by_layer.items():
        specs.sort(key=lambda s: s.first)
        next_block, tokens = 0, 0
        for s in specs:
            if s.first != next_block or s.nbytes != 2 * s.count * abi.slab_bytes:
                raise HandoffError(RejectReason.INCOMPLETE_COVERAGE, f"layer {layer} at block {s.first}")
            next_block, tokens = s.first + s.count, tokens + s.token_count
        if next_block != manifest.num_transfer_blocks or tokens != expected_tokens:
            raise HandoffError(RejectReason.INCOMPLETE_COVERAGE, f"layer {layer}: {next_block} blocks, {tokens} tokens")


def check_chunk_ids(manifest: HandoffManifest, sealed: dict[str, int]) -> None:
    expected = {c.chunk_id for c in manifest.chunks}
    extra, missing = set(sealed) - expected, expected - set(sealed)
    if extra:
        raise HandoffError(RejectReason.UNKNOWN_CHUNK, f"unexpected chunks {sorted(extra)[:3]}")
    if missing:
        raise HandoffError(RejectReason.MISSING_CHUNK, f"missing chunks {sorted(missing)[:3]}")


def validate_landing(manifest: HandoffManifest, seal_fence: IdentityFence | None, sealed: dict[str, int] | None,
                     accepted: dict[str, int], table: ChunkTable) -> None:
    """Raise unless every expected chunk landed with the sealed checksum and is device-visible."""
    if sealed is None or seal_fence is None:
        raise HandoffError(RejectReason.NOT_SEALED, manifest.transfer_id)
    check_fence(manifest.fence, seal_fence)
    check_chunk_ids(manifest, sealed)
    check_coverage(manifest)
    for spec in manifest.chunks:
        if spec.chunk_id not in accepted:
            raise HandoffError(RejectReason.MISSING_CHUNK, spec.chunk_id)
        if accepted[spec.chunk_id] != sealed[spec.chunk_id]:
            raise HandoffError(RejectReason.BAD_CHECKSUM, f"{spec.chunk_id} landed != sealed")
    if not table.all_in(ChunkState.DEVICE_VISIBLE):
        raise HandoffError(RejectReason.NOT_VISIBLE, f"{len(table.ids_in(ChunkState.DEVICE_VISIBLE))} visible")
