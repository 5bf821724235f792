"""`pdserve serve --kv-events-endpoint`: each worker publishes its prefix-cache block events in
vLLM's KV-events wire format, so a subscriber written for vLLM follows pdserve workers unchanged.
The subscriber here declares vLLM's schema itself (as vLLM's examples/online_serving/
kv_events_subscriber.py does) instead of importing pdserve's; it gets a snapshot when it
subscribes and uses the replay socket for what it joined too late to see. Replayed from the start,
the events hold what the worker's tiers hold."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace
from typing import Any

import msgspec
import zmq

from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import TINY, collect, config, prompt, wait_baseline
from tests.runtime.test_kv_fetch_runtime import BPB_TINY


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports after it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            held = [socket.socket() for _ in range(n)]
            for i, s in enumerate(held):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        if not payload:  # vLLM's end-of-replay marker: sequence -1, empty payload
            assert int.from_bytes(seq, "big", signed=True) == -1
            break
        out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    dealer.close(0)
    return out


def test_workers_publish_vllm_kv_events_a_vllm_subscriber_can_follow():
    base = free_ports(4)
    pub, rep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 2}"
    ids = prompt(40, 7)  # two full blocks of 16, then 8 tokens
    ctx = zmq.Context()
    subs = []

    async def scenario():
        async with cluster(config(mode="colocated", replicas=2, kv_events_endpoint=pub,
                                  kv_events_replay_endpoint=rep)) as (backend, _):
            live = []
            for i in range(2):  # joined after the workers' opening batch: a subscription gets a snapshot
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(f"tcp://127.0.0.1:{base + i}")
                subs.append(sub)
                assert sub.poll(10_000)
                topic, seq, payload = sub.recv_multipart()
                live.append((i, int.from_bytes(seq, "big"), DECODE.decode(payload)))
                assert live[-1][2].events == [AllBlocksCleared()]  # nothing cached yet
            tokens, end = await collect(backend, "r1", ids, SamplingParams(max_tokens=2, ignore_eos=True))
            assert len(tokens) == 2, end
            await wait_baseline(backend)
            for i, sub in enumerate(subs):
                while sub.poll(1500):
                    topic, seq, payload = sub.recv_multipart()
                    live.append((i, int.from_bytes(seq, "big"), DECODE.decode(payload)))
            replays = [replay(ctx, f"tcp://127.0.0.1:{base + 2 + i}", 0) for i in range(2)]
            return live, replays

    try:
        live, replays = asyncio.run(scenario())
    finally:
        for s in subs:
            s.close(0)
        ctx.term()
    for kept in replays:  # every worker's log from 0, numbered without gaps, opening with a clear
        assert [seq for seq, _ in kept] == list(range(len(kept))) and kept
        assert isinstance(kept[0][1].events[0], AllBlocksCleared)
    stored = [e for kept in replays for _, batch in kept for e in batch.events if isinstance(e, BlockStored)]
    first, second = stored[:2]
    assert (first.token_ids, first.parent_block_hash) == (list(ids[:16]), None)
    assert (second.token_ids, second.parent_block_hash) == (list(ids[16:32]), first.block_hashes[0])
    assert all(e.block_size == 16 and e.medium == "GPU" and e.lora_id is None for e in stored)
    assert len(stored) == 2  # the 8-token tail is not a full block: never cached, never announced
    worker = next(i for i, kept in enumerate(replays) if any(isinstance(e, BlockStored) for _, b in kept for e in b.events))
    seen = [(seq, batch) for i, seq, batch in live if i == worker]  # what the live subscriber got matches the log
    assert seen and all(batch == dict(replays[worker])[seq] for seq, batch in seen)


def replayed_tiers(kept: list[tuple[int, KVEventBatch]]) -> dict[str, set[bytes]]:
    """The blocks each medium holds by a worker's events, applied from its first batch."""
    media: dict[bytes, set[str]] = {}
    for _, batch in kept:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                media.clear()
            elif isinstance(e, BlockStored):
                for h in e.block_hashes:
                    media.setdefault(h, set()).add(e.medium)
            else:
                for h in e.block_hashes:
                    media.get(h, set()).discard(e.medium)
    return {m: {h for h, on in media.items() if m in on} for m in ("GPU", "CPU")}


def test_replayed_events_match_the_host_tier_after_promotions():
    """A 24-block pool with an 8-block host tier serving prompts over four shared six-block
    documents: their blocks are demoted, promoted back on hits and dropped from the tier (recomputed
    on the device). The events replayed from sequence 0 hold as many blocks on each medium as the
    worker reports in its tiers (/workers)."""
    base = free_ports(2)
    pub, rep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    engine = replace(TINY, kv_cache_bytes=0, num_blocks=24, host_kv_bytes=8 * BPB_TINY)
    docs = [prompt(96, 20 + d) for d in range(4)]
    ctx = zmq.Context()

    async def scenario():
        async with cluster(config(mode="colocated", replicas=1, engine=engine, kv_events_endpoint=pub,
                                  kv_events_replay_endpoint=rep)) as (backend, _):
            for i, d in enumerate((0, 1, 2, 0, 3, 1, 0, 2, 3, 0, 1, 2)):
                ids = docs[d] + prompt(10 + i, 100 + i)
                tokens, end = await collect(backend, f"r{i}", ids, SamplingParams(max_tokens=2, ignore_eos=True))
                assert len(tokens) == 2, end
            await wait_baseline(backend)

            deadline = time.monotonic() + 15  # the load report follows the events by a heartbeat
            while True:
                tiers, load = replayed_tiers(replay(ctx, rep, 0)), backend.workers()[0].load["kv_tiers"]
                counts = {"GPU": len(tiers["GPU"]), "CPU": len(tiers["CPU"])}
                if counts == {"GPU": load["device"]["cached"], "CPU": load["host"]["used"]} or time.monotonic() > deadline:
                    return counts, load
                await asyncio.sleep(0.2)

    try:
        counts, load = asyncio.run(scenario())
    finally:
        ctx.term()
    assert counts == {"GPU": load["device"]["cached"], "CPU": load["host"]["used"]}, load
    assert load["host"]["hits"] > 0 and load["host"]["used"] == 8  # promotions happened, the tier is full
