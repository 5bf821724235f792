"""The handoff manifest: the immutable description of one K/V transfer, fixed before any byte moves.

Contract: a `HandoffManifest` names who may move what where:
  * `fence`      identity fence (tenant, request, generation, attempt, both worker epochs,
                 destination reservation); every frame of the transfer repeats it;
  * `prompt`     prompt digest and token interval; `reused_blocks` prompt blocks are already
                 visible at the destination and are not moved;
  * `identity`   model / tokenizer / adapter / position / mask identity and the K/V ABI hash;
  * `chunks`     the expected chunk manifest: layer x block ranges, bytes, and (once sealed)
                 a checksum per chunk.
Manifests are frozen msgspec Structs; `sealed()` returns a copy with checksums filled in (a
streamed transfer learns checksums as layers are produced, so the source seals at the end).
"""

from __future__ import annotations

import msgspec

from pdserve.engine.kv.kv_abi import CacheIdentity, KvAbi
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.shard_map import ShardLayout


class IdentityFence(msgspec.Struct, frozen=True):
    tenant: str
    request_id: str
    generation: int
    attempt: int
    source_worker: str
    source_epoch: int
    destination_worker: str
    destination_epoch: int
    reservation_id: str


class PromptSpan(msgspec.Struct, frozen=True):
    digest: str
    num_tokens: int
    reused_blocks: int  # leading prompt blocks already visible at the destination

    def first_token(self, block_size: int) -> int:
        return self.reused_blocks * block_size


class ChunkSpec(msgspec.Struct, frozen=True):
    chunk_id: str
    layer: int
    first: int  # index into the manifest's transferred-block list
    count: int  # number of blocks
    token_start: int
    token_count: int
    nbytes: int
    checksum: int | None = None


class HandoffManifest(msgspec.Struct, frozen=True):
    transfer_id: str
    fence: IdentityFence
    prompt: PromptSpan
    identity: CacheIdentity
    abi: KvAbi
    dst_blocks: tuple[int, ...]  # destination block of each transferred prompt block, in order
    chunks: tuple[ChunkSpec, ...]
    schedule: str = "layerwise"  # or "serialized"
    shards: ShardLayout = msgspec.field(default_factory=ShardLayout)  # the source's TP layout beside the logical ABI (shard_map.py)

    @property
    def num_transfer_blocks(self) -> int:
        return len(self.dst_blocks)

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def chunk(self, chunk_id: str) -> ChunkSpec:
        for spec in self.chunks:
            if spec.chunk_id == chunk_id:
                return spec
        raise HandoffError(RejectReason.UNKNOWN_CHUNK, chunk_id)

    def chunk_dst_blocks(self, spec: ChunkSpec) -> list[int]:
        return list(self.dst_blocks[spec.first : spec.first + spec.count])

    def sealed(self, checksums: dict[str, int]) -> "HandoffManifest":
        """A copy whose chunks carry `checksums`; every chunk must have one."""
        missing = [c.chunk_id for c in self.chunks if c.chunk_id not in checksums]
        if missing:
            raise HandoffError(RejectReason.MISSING_CHUNK, f"no checksum for {missing[:3]}")
        chunks = tuple(msgspec.structs.replace(c, checksum=checksums[c.chunk_id]) for c in self.chunks)
        return msgspec.structs.replace(self, chunks=chunks)


def chunk_id_for(layer: int, first: int, count: int) -> str:
    return f"L{layer}:{first}+{count}"


def plan_chunks(abi: KvAbi, prompt: PromptSpan, num_blocks: int, blocks_per_chunk: int) -> tuple[ChunkSpec, ...]:
    """Layer-major chunks of at most `blocks_per_chunk` blocks covering every transferred token."""
    if blocks_per_chunk <= 0:
        raise ValueError("blocks_per_chunk must be positive")
    base = prompt.first_token(abi.block_size)
    chunks = []
    for layer in range(abi.num_layers):
        for first in range(0, num_blocks, blocks_per_chunk):
            count = min(blocks_per_chunk, num_blocks - first)
            start = base + first * abi.block_size
            tokens = min(count * abi.block_size, prompt.num_tokens - start)
            chunks.append(ChunkSpec(chunk_id_for(layer, first, count), layer, first, count,
                                    start, tokens, 2 * count * abi.slab_bytes))
    return tuple(chunks)


def build_manifest(transfer_id: str, fence: IdentityFence, prompt: PromptSpan, identity: CacheIdentity,
                   abi: KvAbi, dst_blocks: list[int], blocks_per_chunk: int,
                   schedule: str = "layerwise", shards: ShardLayout | None = None) -> HandoffManifest:
    """Plan the expected chunks for moving `dst_blocks` worth of prompt K/V under `fence`."""
    needed = -(-(prompt.num_tokens - prompt.first_token(abi.block_size)) // abi.block_size)
    if needed != len(dst_blocks):
        raise HandoffError(RejectReason.INCOMPLETE_COVERAGE,
                           f"prompt needs {needed} transferred blocks, reservation gives {len(dst_blocks)}")
    chunks = plan_chunks(abi, prompt, len(dst_blocks), blocks_per_chunk)
    return HandoffManifest(transfer_id, fence, prompt, identity, abi, tuple(dst_blocks), chunks, schedule,
                           shards or ShardLayout())


_FENCE_REASONS = (
    ("tenant", RejectReason.WRONG_TENANT),
    ("request_id", RejectReason.WRONG_REQUEST),
    ("generation", RejectReason.WRONG_GENERATION),
    ("attempt", RejectReason.WRONG_ATTEMPT),
    ("source_worker", RejectReason.WRONG_SOURCE_EPOCH),
    ("source_epoch", RejectReason.WRONG_SOURCE_EPOCH),
    ("destination_worker", RejectReason.WRONG_DESTINATION_EPOCH),
    ("destination_epoch", RejectReason.WRONG_DESTINATION_EPOCH),
    ("reservation_id", RejectReason.WRONG_RESERVATION),
)

_IDENTITY_REASONS = (
    ("model_hash", RejectReason.WRONG_MODEL),
    ("tokenizer_hash", RejectReason.WRONG_TOKENIZER),
    ("abi_hash", RejectReason.WRONG_ABI),
    ("adapter", RejectReason.WRONG_ADAPTER),
    ("position_policy", RejectReason.WRONG_POSITION_POLICY),
    ("mask_policy", RejectReason.WRONG_MASK_POLICY),
)


def check_fence(expected: IdentityFence, got: IdentityFence) -> None:
    """Raise with the reason of the first fence field that differs."""
    for name, reason in _FENCE_REASONS:
        if getattr(expected, name) != getattr(got, name):
            raise HandoffError(reason, f"{name}: expected {getattr(expected, name)!r}, got {getattr(got, name)!r}")


def check_identity(expected: CacheIdentity, expected_abi: KvAbi, manifest: HandoffManifest) -> None:
    """Raise unless the manifest's model identity and K/V ABI are exactly the destination's."""
    if manifest.abi.abi_hash != expected_abi.abi_hash or manifest.identity.abi_hash != expected_abi.abi_hash:
        raise HandoffError(RejectReason.WRONG_ABI, f"{manifest.abi.abi_hash} != {expected_abi.abi_hash}")
    for name, reason in _IDENTITY_REASONS:
        if getattr(expected, name) != getattr(manifest.identity, name):
            raise HandoffError(reason, f"{name} differs")


def ledger_fixture(manifest: HandoffManifest, evidence: str = "synthetic") -> dict:
    """The manifest in the form of the ledger's handoff-manifest fixture (`pdserve check
    handoff-manifest`): its fence, model identity and K/V ABI; the prompt's blocks `b0..` (the
    token interval covers whole blocks, as the chunks do), those already visible at the
    destination, and, as expected values, the blocks and bytes the manifest itself moves. The
    prefill side's own prefix reuse is not part of a manifest, so every block counts as computed.
    The check accepts only `evidence == "synthetic"`: the label of a manifest built for a test."""
    abi, fence, span, model = manifest.abi, manifest.fence, manifest.prompt, manifest.identity
    prompt = [f"b{i}" for i in range(span.reused_blocks + manifest.num_transfer_blocks)]
    return {
        "check": "handoff-manifest", "evidence": evidence,
        "identity": {"tenant": fence.tenant, "request": fence.request_id, "generation": fence.generation,
                     "attempt": fence.attempt, "source_epoch": fence.source_epoch,
                     "destination_epoch": fence.destination_epoch, "reservation": fence.reservation_id,
                     "prompt_digest": span.digest, "token_interval": [0, len(prompt) * abi.block_size]},
        "model": {"checkpoint": model.model_hash, "tokenizer": model.tokenizer_hash, "adapter": model.adapter,
                  "position": model.position_policy, "mask": model.mask_policy},
        "tensor_abi": {"layers": abi.num_layers, "kv_heads": abi.num_kv_heads, "head_dim": abi.head_dim,
                       "dtype_bytes": abi.dtype_bytes, "block_tokens": abi.block_size},
        "transfer": {"transfer_id": manifest.transfer_id, "source": fence.source_worker,
                     "destination": fence.destination_worker, "state": "UNPUBLISHED"},
        "prompt_blocks": prompt, "prefill_reusable": [], "decode_visible": prompt[: span.reused_blocks],
        "expected": {"compute_blocks": prompt, "transfer_blocks": prompt[span.reused_blocks :],
                     "compute_count": len(prompt), "transfer_count": manifest.num_transfer_blocks,
                     "logical_bytes": manifest.total_bytes},
    }
