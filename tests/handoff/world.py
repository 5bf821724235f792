"""A small two-worker handoff world for tests: source pool, destination pool, endpoint, manifest."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.kv.kv_abi import CacheIdentity, KvAbi
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.credits import ByteCredits
from pdserve.handoff.destination import ReserveRequest
from pdserve.handoff.endpoint import DecodeEndpoint
from pdserve.handoff.kvbytes import pool_bytes
from pdserve.handoff.manifest import HandoffManifest, IdentityFence, PromptSpan, build_manifest
from pdserve.handoff.reservations import PooledDestinationBlocks
from pdserve.handoff.gate import LayerGate
from pdserve.handoff.source import SourceTransfer
from pdserve.handoff.trace import TraceSink

ABI = KvAbi(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
IDENTITY = CacheIdentity(model_hash="m-1", tokenizer_hash="t-1", abi_hash=ABI.abi_hash)
_ids = itertools.count()


@dataclass
class World:
    src_pool: KvPool
    dst_pool: KvPool
    endpoint: DecodeEndpoint
    credits: ByteCredits
    trace: TraceSink
    src_blocks: list[int]

    @property
    def blocks(self) -> PooledDestinationBlocks:
        return self.endpoint.blocks

    def close(self) -> None:
        self.src_pool.close(unlink=True)
        self.dst_pool.close(unlink=True)

    def assert_no_leaks(self) -> None:
        self.credits.assert_no_leaks()
        self.endpoint.assert_no_leaks()
        for rid in list(self.endpoint.directory.owners()):
            self.endpoint.retire(rid)
        self.endpoint.directory.assert_no_leaks()
        self.blocks.assert_no_leaks()


def make_world(num_tokens: int = 22, credit_bytes: int = 4096, shm: bool = False, seed: int = 0,
               num_dst_blocks: int = 64) -> World:
    src = KvPool(ABI, 32, shm_name=f"pdsrc-{uuid.uuid4().hex[:8]}" if shm else None)
    dst = KvPool(ABI, num_dst_blocks, shm_name=f"pddst-{uuid.uuid4().hex[:8]}" if shm else None)
    gen = torch.Generator().manual_seed(seed)
    src.tensor.copy_(torch.randn(src.tensor.shape, generator=gen).to(src.tensor.dtype))
    trace = TraceSink()
    endpoint = DecodeEndpoint("decode-0", 7, dst, PooledDestinationBlocks(num_dst_blocks), IDENTITY, trace=trace)
    num_blocks = -(-num_tokens // ABI.block_size)
    src_blocks = list(np.random.default_rng(seed).permutation(32)[:num_blocks])
    return World(src, dst, endpoint, ByteCredits(credit_bytes), trace, [int(b) for b in src_blocks])


def reserve_request(world: World, num_tokens: int = 22, generation: int = 1, attempt: int = 0,
                    transfer_id: str | None = None, request_id: str = "req-1", growth: int = 2) -> ReserveRequest:
    return ReserveRequest(transfer_id or f"xfer-{next(_ids)}", "tenant-a", request_id, generation, attempt,
                          "prefill-0", 3, "digest-1", num_tokens, -(-num_tokens // ABI.block_size), growth)


def open_transfer(world: World, request: ReserveRequest, blocks_per_chunk: int = 2,
                  gate: LayerGate | None = None) -> tuple[HandoffManifest, SourceTransfer]:
    """Reserve at the destination, build the manifest and the source transfer (manifest not yet sent)."""
    reservation = world.endpoint.reserve(request)
    fence = IdentityFence(request.tenant, request.request_id, request.generation, request.attempt,
                          request.source_worker, request.source_epoch, world.endpoint.worker,
                          world.endpoint.epoch, reservation.reservation_id)
    prompt = PromptSpan(request.prompt_digest, request.num_tokens, 0)
    manifest = build_manifest(request.transfer_id, fence, prompt, IDENTITY, ABI, list(reservation.prompt_blocks),
                              blocks_per_chunk)
    src = SourceTransfer(manifest, pool_bytes(world.src_pool), world.src_blocks, world.credits,
                         gate or LayerGate(ABI.num_layers), world.trace)
    return manifest, src


def published_bytes_equal(world: World, request_id: str) -> bool:
    """Bitwise: every published destination block equals its source block, all layers, K and V."""
    handle = world.endpoint.directory.lookup(request_id)
    src = world.src_pool.tensor[:, :, world.src_blocks].contiguous().view(torch.uint8)
    dst = world.dst_pool.tensor[:, :, list(handle.block_table)].contiguous().view(torch.uint8)
    return bool(torch.equal(src, dst))


# -- a synchronous pump: frames go straight from the source to the endpoint and back ----------
from pdserve.handoff.errors import RejectReason  # noqa: E402
from pdserve.handoff.frames import ChunkAck, ManifestFrame, PublishAck  # noqa: E402
from pdserve.handoff.kvbytes import copy_chunk  # noqa: E402
from pdserve.handoff.states import TxnState  # noqa: E402


def deliver(src: SourceTransfer, answers: list) -> None:
    for answer in answers:
        if isinstance(answer, ChunkAck):
            src.on_ack(answer)
        elif isinstance(answer, PublishAck):
            src.on_publish_ack(answer)


def pump_chunk(world: World, src: SourceTransfer, chunk_id: str, mutate=None) -> list:
    frame = src.begin_send(chunk_id)
    spec = src.manifest.chunk(chunk_id)
    copy_chunk(src.raw, src.chunk_src_blocks(spec), world.endpoint.raw, src.manifest.chunk_dst_blocks(spec), spec.layer)
    src.mark_sent(frame)
    answers = world.endpoint.handle(mutate(frame) if mutate else frame)
    deliver(src, answers)
    return answers


def pump_all(world: World, src: SourceTransfer, seal: bool = True, skip: set[str] = frozenset()) -> list:
    src.gate.mark_all_ready()
    answers = world.endpoint.handle(ManifestFrame(src.manifest))
    for spec in src.manifest.chunks:
        if spec.chunk_id not in skip:
            answers += pump_chunk(world, src, spec.chunk_id)
    if seal:
        final = world.endpoint.handle(src.seal())
        deliver(src, final)
        answers += final
    return answers


def finish(world: World, *sources: SourceTransfer) -> None:
    """Abort whatever is still open on either side, then check every pool for leaks."""
    for src in sources:
        if src.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
            src.abort(RejectReason.CANCELLED)
    for txn in world.endpoint.transfers.values():
        if txn.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
            world.endpoint.abort(txn.transfer_id, RejectReason.CANCELLED)
    world.assert_no_leaks()
    world.close()
