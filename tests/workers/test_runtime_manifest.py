"""A manifest the runtime builds passes the ledger's handoff-manifest check: the router's own
admission makes the ReserveKv and the Prefill plan (generation, attempt counted from 1, the
destination's registered epoch and reservation), and the prefill worker's `HandoffSender`
fences it with its own id and epoch, exactly as `HandoffSender.start` does."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pdserve.engine.kv.kv_abi import CacheIdentity, KvAbi
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.handoff.manifest import ledger_fixture
from pdserve.handoff.trace import TraceSink
from pdserve.ledger.checks import CheckFailed, run_check
from pdserve.workers import messages as m
from pdserve.workers.handoff_io import HandoffSender
from tests.router.process.test_router_frontend import PROMPT, Harness, collect
from tests.router.router_fixtures import MODEL

KV_ABI = KvAbi(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16")
IDENTITY = CacheIdentity(model_hash=MODEL, tokenizer_hash="tok-1", abi_hash=KV_ABI.abi_hash)


async def _router_plan(reserved_blocks: tuple[int, ...], visible: int) -> tuple[Harness, m.ReserveKv, m.Prefill]:
    """One request through the router's admission, up to the Prefill it sends the prefill worker."""
    h = Harness(["p0"], ["d0"])
    task = asyncio.create_task(collect(h.backend, "r"))
    _, reserve = await h.next_sent(m.ReserveKv)
    await h.deliver(m.Reserved("d0", 1, "r", reserve.transfer_id, True, None, reserved_blocks, visible, "dres-7"))
    _, prefill = await h.next_sent(m.Prefill)
    task.cancel()
    return h, reserve, prefill


def _runtime_manifest(reserved_blocks: tuple[int, ...] = (4, 9), visible: int = 0):
    h, reserve, prefill = asyncio.run(_router_plan(reserved_blocks, visible))
    pool = KvPool(KV_ABI, 8)
    sender = HandoffSender("p0", h.epochs["p0"], pool, IDENTITY, TraceSink(), on_done=lambda *a: None)
    manifest = sender.manifest_for(prefill.request_id, prefill.prompt_ids, prefill.plan, prefill.plan.tenant, "serialized")
    return h, reserve, prefill, manifest


@pytest.mark.parametrize("visible", [0, 1])
def test_the_ledger_manifest_check_passes_on_a_runtime_manifest(visible):
    h, reserve, prefill, manifest = _runtime_manifest(visible=visible)
    assert reserve.attempt == prefill.plan.attempt == manifest.fence.attempt == m.FIRST_ATTEMPT == 1
    fence = manifest.fence
    assert (fence.source_worker, fence.source_epoch) == ("p0", h.backend.registered["p0"].epoch)
    assert (fence.destination_worker, fence.destination_epoch) == ("d0", h.backend.registered["d0"].epoch)
    assert fence.generation == reserve.generation >= 1 and fence.reservation_id == "dres-7"
    derived = run_check("handoff-manifest", ledger_fixture(manifest))
    assert derived["logical_bytes"] == manifest.total_bytes
    assert derived["transfer_count"] == len(PROMPT) // KV_ABI.block_size + 1 - visible


def test_the_check_still_refuses_an_attempt_counted_from_zero():
    _, _, _, manifest = _runtime_manifest()
    zero = msgspec.structs.replace(manifest, fence=msgspec.structs.replace(manifest.fence, attempt=0))
    with pytest.raises(CheckFailed, match="attempt must count from 1"):
        run_check("handoff-manifest", ledger_fixture(zero))
