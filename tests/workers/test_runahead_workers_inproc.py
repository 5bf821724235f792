"""KV-Runahead over real worker objects in one process (no router): stage 0 on one prefill
worker, stage 1 on another over a shm-pull chain link, the complete K/V handed to a decode worker
over TCP. The decode worker's K/V bytes and the first token equal one engine's chunked prefill,
bit for bit; a chain whose link is cancelled mid-stream ends with `runahead_failed` and every
pool back at baseline."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams, SeqMode
from pdserve.workers import messages as m
from pdserve.workers.worker import Worker, WorkerConfig

ENGINE = EngineConfig(model="tiny", dtype="float32", num_blocks=96, max_num_batched_tokens=64, num_threads=1)
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
STAGE = SamplingParams(max_tokens=2, ignore_eos=True)
PROMPT = [(i * 7919 + 13) % 250 + 3 for i in range(328)]  # 6 chunks: stage 0 takes 3 (192 tokens)
SPLIT = 192


class Cluster:
    """Three workers whose messages to the router are captured, each pumped by a thread."""

    def __init__(self):
        torch.set_num_threads(1)
        self.p0, self.p1, self.d = (Worker(WorkerConfig(wid, role, "tcp://127.0.0.1:9", engine=ENGINE))
                                    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")))
        self.sent: dict[str, list] = {}
        for w in self.workers:
            self.sent[w.id] = box = []
            w.send = box.append
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    @property
    def workers(self):
        return (self.p0, self.p1, self.d)

    def of(self, wid: str, kind) -> list:
        return [x for x in self.sent[wid] if isinstance(x, kind)]

    def start_chain(self, rid: str) -> None:
        """What the router sends: reservations at D and at stage 1, then both stages' Prefills."""
        self.d.handle(m.ReserveKv(rid, f"{rid}/g1", 1, tuple(PROMPT), PARAMS, "p1", 1))
        self.p1.handle(m.ReserveKv(rid, f"{rid}/g1/ra1", 1, tuple(PROMPT), PARAMS, "p0", 1, chain_start=SPLIT))
        at_d, at_p1 = self.of("d0", m.Reserved)[-1], self.of("p1", m.Reserved)[-1]
        assert at_d.ok and at_p1.ok and len(at_p1.dest_blocks) == SPLIT // 16
        link = m.TransferPlan(f"{rid}/g1/ra1", 1, 1, "default", "p1", 1, at_p1.reservation_id, at_p1.dest_blocks,
                              at_p1.num_visible_blocks, "shm", self.p1.runahead.address, self.p1.engine.pool.shm_name,
                              self.p1.engine.pool.num_blocks)
        onward = m.TransferPlan(f"{rid}/g1", 1, 1, "default", "d0", 1, at_d.reservation_id, at_d.dest_blocks,
                                at_d.num_visible_blocks, "tcp", self.d.decode.address)
        self.p0.handle(m.Prefill(rid, tuple(PROMPT[:SPLIT]), STAGE, 5, link, 0, m.ChainStage(0, 2)))
        self.p1.handle(m.Prefill(rid, tuple(PROMPT), PARAMS, 5, onward, 0, m.ChainStage(1, 2, SPLIT, f"{rid}/g1/ra1")))
        self.reserved_at_d = at_d

    def pump(self, worker, hooks=()) -> None:
        def loop():
            while not self.stop.is_set():
                worker.drain_events()
                if worker.runahead is not None:
                    worker.runahead.poll()
                if worker.engine.has_unfinished():
                    worker.step()
                else:
                    time.sleep(0.002)
        self.threads.append(threading.Thread(target=loop, daemon=True))
        self.threads[-1].start()

    def run_until(self, done, timeout_s: float = 120.0) -> None:
        for w in self.workers:
            self.pump(w)
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, {k: [type(x).__name__ for x in v] for k, v in self.sent.items()}
            time.sleep(0.01)
        self.stop.set()
        for t in self.threads:
            t.join(10)

    def settle(self) -> None:
        """Let transfer threads finish and their events apply (no pump runs any more)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for w in self.workers:
                w.drain_events()
            if not (self.p0.prefill.started or self.p1.prefill.started or self.p0.engine.prefilled or self.p1.engine.prefilled):
                return
            time.sleep(0.01)

    def assert_baseline(self) -> None:
        for w in self.workers:
            w.engine.check_integrity()
            w.engine.assert_no_leaks()
        self.p0.runahead.assert_no_leaks()
        self.p1.runahead.assert_no_leaks()
        self.d.decode.endpoint.assert_no_leaks()

    def close(self) -> None:
        self.stop.set()
        for w in self.workers:
            w.close()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def _done(c: Cluster, rid: str, side: str, wid: str) -> bool:
    return any(x.request_id == rid and x.side == side and x.published for x in c.of(wid, m.TransferDone))


def test_chain_kv_at_the_decode_worker_equals_single_chunked_prefill(cluster):
    c = cluster
    ref = Engine(ENGINE)
    ref.add_request("r", PROMPT, PARAMS, mode=SeqMode.PREFILL_ONLY, seed=5)
    while "r" not in ref.prefilled:
        ref.step()
    want_token = ref.prefilled["r"].output_ids[0]
    ref_blocks = ref.kv_blocks("r")

    c.start_chain("r")
    c.run_until(lambda: _done(c, "r", "source", "p1") and _done(c, "r", "destination", "d0")
                and _done(c, "r", "source", "p0"))
    c.settle()
    firsts = [i for x in c.of("p1", m.Tokens) for i in x.items if i.prefilled]
    assert [i.token_ids for i in firsts] == [(want_token,)]
    assert not c.of("p0", m.Tokens)  # an inner stage's token never reaches the router
    got_blocks = list(c.reserved_at_d.dest_blocks)
    for layer in range(ref.abi.num_layers):
        assert c.d.engine.pool.read_chunk(layer, got_blocks) == ref.pool.read_chunk(layer, ref_blocks), layer
    c.d.handle(m.Abort("r"))  # the router would StartDecode; here the published K/V is returned
    ref.release_prefilled("r")
    c.assert_baseline()


def test_a_link_cancelled_mid_stream_fails_the_chain_without_leaks(cluster):
    c = cluster
    inner_hook = c.p0.prefill.layer_hook

    def cancel_at_layer_3(layer, progress):  # the source gives up in its last chunk, after layer 3
        inner_hook(layer, progress)
        if layer == 3 and any(p.completes for p in progress):
            c.p0.prefill.sender.cancel("r")
    c.p0.prefill.layer_hook = cancel_at_layer_3
    c.start_chain("r")
    c.run_until(lambda: any(e.code == "runahead_failed" for e in c.of("p1", m.WorkerError)))
    c.settle()
    assert not [i for x in c.of("p1", m.Tokens) for i in x.items]  # no token from a broken chain
    for w in (c.p0, c.p1, c.d):
        w.handle(m.Abort("r"))  # the router's fallback tells every stage and the decode worker
    c.settle()
    c.assert_baseline()
