"""A worker's heartbeats carry its prefix cache's block events (a resync first and when asked),
and the router's index built from them over the wire equals the engine's cache."""

from __future__ import annotations

import random

from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.router.kv.kv_index import KvDelta, KvIndex, KvOutcome, hash_key
from pdserve.workers import messages as m
from pdserve.workers.worker import Worker, WorkerConfig


def beat(worker: Worker, index: KvIndex) -> tuple[m.Heartbeat, KvOutcome]:
    hb = m.decode_to_router(m.encode(worker.heartbeat()))  # over the wire, as the router reads it
    return hb, index.apply(hb.worker_id, hb.epoch, KvDelta.from_report(hb.kv)).outcome


def prompt(seed: int, n: int = 80) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 256) for _ in range(n))


def serve(worker: Worker, rid: str, prompt: tuple[int, ...]) -> None:
    worker.add_local(m.Generate(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), seed=1))
    while worker.engine.has_unfinished():
        worker.engine.step()


def test_heartbeats_ship_deltas_and_a_resync_when_asked():
    engine = EngineConfig(model="tiny", num_blocks=16, max_num_batched_tokens=64)
    worker = Worker(WorkerConfig("c0", "colocated", "tcp://127.0.0.1:9", engine=engine))  # never sends here
    index = KvIndex()
    try:
        hb, outcome = beat(worker, index)
        assert hb.kv.resync and outcome is KvOutcome.RESYNCED  # an epoch's first heartbeat is a resync
        for i in range(6):  # 16 blocks: later prompts evict earlier prompts' blocks
            serve(worker, f"r{i}", prompt(i))
            hb, outcome = beat(worker, index)
            assert not hb.kv.resync and outcome is KvOutcome.APPLIED
            assert set(index.held("c0")) == {hash_key(h) for h in worker.engine.blocks.cached}
        assert worker.engine.blocks.num_evictions > 0
        serve(worker, "lost", prompt(100))
        worker.heartbeat()  # a heartbeat the router never sees: the next one shows a gap
        serve(worker, "after", prompt(101))
        hb, outcome = beat(worker, index)
        assert outcome is KvOutcome.RESYNC_NEEDED
        worker.handle(m.decode_to_worker(m.encode(m.ResyncKv())))
        hb, outcome = beat(worker, index)
        assert hb.kv.resync and outcome is KvOutcome.RESYNCED
        assert set(index.held("c0")) == {hash_key(h) for h in worker.engine.blocks.cached}
        assert not beat(worker, index)[0].kv.resync  # one resync per request
    finally:
        worker.close()


def test_a_beat_does_not_wait_long_for_a_held_lock():
    """The engine thread holds the worker's lock through each step's bookkeeping; on a loaded CPU
    it can take it back before the heartbeat thread runs, step after step. A beat waits at most
    LOCK_WAIT_S, then repeats the last load (its collective seconds already reported), without
    block events, which the next beat under the lock carries; before, it waited for the lock and
    the router could retire a busy worker as hung."""
    import threading
    import time

    from pdserve.workers.heartbeat import LOCK_WAIT_S

    engine = EngineConfig(model="tiny", num_blocks=16, max_num_batched_tokens=64)
    worker = Worker(WorkerConfig("c0", "colocated", "tcp://127.0.0.1:9", engine=engine))  # never sends here
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with worker.lock:
            held.set()
            release.wait(30)

    try:
        first = worker.heartbeat()  # under the lock: the whole key set
        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        held.wait(10)
        beats: list = []
        beating = threading.Thread(target=lambda: beats.append(worker.heartbeat()), daemon=True)
        started = time.monotonic()
        beating.start()
        beating.join(LOCK_WAIT_S + 10)
        waited = time.monotonic() - started
        release.set()
        assert beats, "the beat waited for the lock"
        assert waited >= LOCK_WAIT_S * 0.9 and beats[0].load == first.load and beats[0].kv is None
        serve(worker, "r", prompt(1))
        assert worker.heartbeat().kv.events  # the lock free again: the blocks it stored are reported
    finally:
        release.set()
        worker.close()
