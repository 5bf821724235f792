"""`pdserve serve --kv-events-endpoint`: each worker publishes its prefix-cache block events in
vLLM's KV-events wire format, so a subscriber written for vLLM follows pdserve workers unchanged.
The subscriber here declares vLLM's schema itself (as vLLM's examples/online_serving/
kv_events_subscriber.py does) instead of importing pdserve's, and uses the replay socket for
what it joined too late to see."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgspec
import zmq

from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import collect, config, prompt, wait_baseline


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
            for i in range(2):
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(f"tcp://127.0.0.1:{base + i}")
                subs.append(sub)
            tokens, end = await collect(backend, "r1", ids, SamplingParams(max_tokens=2, ignore_eos=True))
            assert len(tokens) == 2, end
            await wait_baseline(backend)
            live = []
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
