"""Handoffs between workers of different tensor-parallel shapes (handoff/shard_map.py).

Prefill TP 2 -> decode TP 1 and TP 1 -> TP 2, through the real manifest, fence, chunk checksums
and publication: the published K/V equal the source's bytes bitwise; against a TP 1 prefill of the
same prompt, layer 0's K/V are bitwise equal (its input never passes a row-parallel sum) and later
layers agree within fp32 rounding (the all_reduce sums o_proj/down_proj in another order)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.runner import build_batch
from pdserve.engine.scheduler import StepPlan
from pdserve.engine.sequence import SamplingParams, Sequence
from pdserve.handoff.credits import ByteCredits
from pdserve.handoff.destination import ReserveRequest
from pdserve.handoff.endpoint import DecodeEndpoint
from pdserve.handoff.errors import RejectReason
from pdserve.handoff.frames import ManifestFrame, PublishAck
from pdserve.handoff.gate import LayerGate
from pdserve.handoff.kvbytes import pool_bytes
from pdserve.handoff.manifest import IdentityFence, PromptSpan, build_manifest
from pdserve.handoff.reservations import PooledDestinationBlocks
from pdserve.handoff.shard_map import ShardLayout, head_moves, layout_of
from pdserve.handoff.source import SourceTransfer
from pdserve.handoff.states import TxnState
from pdserve.handoff.trace import TraceSink
from tests.handoff.world import World, pump_all
from tests.helpers.checkpoints import make_random_checkpoint

PROMPT_LEN = 45
_ids = itertools.count()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """TP 2, TP 1 and a second TP 1 engine over one fp32 checkpoint with 2 K/V heads."""
    ckpt = make_random_checkpoint(tmp_path_factory.mktemp("tpshape"), hidden=128, layers=3, heads=4, kv_heads=2,
                                  intermediate=256, vocab=128, seed=4)
    made = {}
    for name, tp in (("tp2", 2), ("tp1", 1), ("tp1b", 1)):
        made[name] = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=16, num_blocks=64, tp=tp))
    yield made
    for eng in made.values():
        eng.close()


def prefill(engine: Engine, prompt: list[int]) -> list[int]:
    """One-shot prefill of `prompt` into fresh blocks of `engine`; -> its block table."""
    seq = Sequence(f"p{next(_ids)}", tuple(prompt), SamplingParams(), seed=0)
    seq.block_table = engine.blocks.allocate(-(-len(prompt) // engine.abi.block_size))
    batch = build_batch(StepPlan(prefill=[(seq, len(prompt))]), engine.abi.block_size)
    engine.model.forward(batch.token_ids, batch.positions, batch.meta, engine.pool.tensor, batch.logits_rows)
    return list(seq.block_table)


def open_handoff(src: Engine, src_blocks: list[int], dst: Engine, shards: ShardLayout | None = None):
    """Reserve at `dst` and build the source side of one transaction; -> (world, transfer, request id)."""
    endpoint = DecodeEndpoint("decode-0", 7, dst.pool, PooledDestinationBlocks(dst.pool.num_blocks), dst.identity,
                              trace=TraceSink())
    world = World(src.pool, dst.pool, endpoint, ByteCredits(1 << 20), TraceSink(), src_blocks)
    tid = f"x{next(_ids)}"
    request = ReserveRequest(tid, "t", f"r{tid}", 1, 0, "prefill-0", 3, "dg", PROMPT_LEN, len(src_blocks), 1)
    reservation = endpoint.reserve(request)
    fence = IdentityFence("t", request.request_id, 1, 0, "prefill-0", 3, "decode-0", 7, reservation.reservation_id)
    manifest = build_manifest(tid, fence, PromptSpan("dg", PROMPT_LEN, 0), src.identity, src.abi,
                              list(reservation.prompt_blocks), 2, shards=shards or layout_of(src.pool))
    transfer = SourceTransfer(manifest, pool_bytes(src.pool), src_blocks, world.credits,
                              LayerGate(src.abi.num_layers), world.trace)
    return world, transfer, request.request_id


def handoff(src: Engine, src_blocks: list[int], dst: Engine):
    """Move the prompt's K/V from `src` to `dst` through one handoff transaction; -> (manifest,
    published destination blocks)."""
    world, transfer, rid = open_handoff(src, src_blocks, dst)
    pump_all(world, transfer)
    assert transfer.state is TxnState.PUBLISHED
    table = list(world.endpoint.directory.lookup(rid).block_table)
    world.assert_no_leaks()  # retires the published request's blocks
    return transfer.manifest, table


def kv(engine: Engine, blocks: list[int]) -> torch.Tensor:
    return engine.pool.tensor[:, :, blocks].clone()  # [L, 2, n, B, H_kv, D]


def prompt_ids() -> list[int]:
    return torch.randint(0, 128, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.mark.parametrize("src_name,dst_name,moves", [
    ("tp2", "tp1", [(0, 0, 0), (1, 1, 0)]),  # (head, source rank, destination rank)
    ("tp1", "tp2", [(0, 0, 0), (1, 0, 1)]),
], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_handoff_between_shapes_moves_logical_kv_exactly(engines, src_name, dst_name, moves):
    src, dst, ref = engines[src_name], engines[dst_name], engines["tp1b"]
    assert src.identity.identity_hash == dst.identity.identity_hash  # the logical ABI: the fence passes
    src_blocks, ref_blocks = prefill(src, prompt_ids()), prefill(ref, prompt_ids())
    manifest, dst_blocks = handoff(src, src_blocks, dst)
    assert manifest.shards == ShardLayout(tp=src.config.tp)
    plan = head_moves(manifest.shards, layout_of(dst.pool), dst.abi)
    assert [(m.head, m.src_rank, m.dst_rank) for m in plan] == moves
    assert [(m.row_offset, m.nbytes) for m in plan] == [(0, 32 * 4), (32 * 4, 32 * 4)]  # head_dim 32, fp32
    moved, sent, tp1 = kv(dst, dst_blocks), kv(src, src_blocks), kv(ref, ref_blocks)
    assert torch.equal(moved.view(torch.int32), sent.view(torch.int32))  # the transfer: bitwise
    assert torch.equal(moved[0].view(torch.int32), tp1[0].view(torch.int32))  # layer 0 vs a TP 1 prefill: bitwise
    torch.testing.assert_close(moved[1:], tp1[1:], rtol=1e-5, atol=1e-5)
    for eng, blocks in ((src, src_blocks), (ref, ref_blocks)):
        eng.blocks.release(blocks)
        eng.assert_no_leaks()


def test_a_layout_that_does_not_tile_the_heads_is_refused(engines):
    src, dst = engines["tp2"], engines["tp1"]
    src_blocks = prefill(src, prompt_ids())
    world, transfer, _ = open_handoff(src, src_blocks, dst, shards=ShardLayout(tp=3))
    answers = world.endpoint.handle(ManifestFrame(transfer.manifest))
    assert [(a.published, a.reason) for a in answers if isinstance(a, PublishAck)] == [(False, RejectReason.WRONG_ABI.value)]
    transfer.abort(RejectReason.CANCELLED)
    world.assert_no_leaks()
    src.blocks.release(src_blocks)
    src.assert_no_leaks()
