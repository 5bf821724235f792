"""Property tests: random interleavings of chunk events, losses, duplicates, corruption, retries,
reroutes and aborts. After every step credits stay inside the window and a request has at most one
published owner; every published cache is complete and bitwise equal to the source; at the end
every block and credit is back."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import ChunkAck, ChunkFrame, ManifestFrame
from pdserve.handoff.kvbytes import chunk_views, copy_chunk
from pdserve.handoff.states import ChunkState, TxnState

from tests.handoff.world import deliver, finish, make_world, open_transfer, published_bytes_equal, reserve_request

# Repetition weights the draw toward progress so many runs reach publication.
ACTIONS = ["ready"] * 40 + ["send"] * 80 + ["deliver"] * 80 + ["answer"] * 80 + ["seal"] * 20 + \
          ["dup"] * 8 + ["drop"] * 6 + ["corrupt"] * 6 + ["resend"] * 20 + ["abort_src", "abort_dst", "reroute"]


class Model:
    def __init__(self, world):
        self.world, self.sources, self.net, self.back, self.generation = world, [], [], [], 0
        self.reroute()

    def reroute(self):
        if len(self.sources) >= 3:
            return
        self.generation += 1
        self.world.endpoint.supersede("req-1", self.generation)
        req = reserve_request(self.world, generation=self.generation, attempt=self.generation)
        manifest, src = open_transfer(self.world, req)
        self.sources.append(src)
        self.net.append(ManifestFrame(manifest))

    def step(self, action: str, k: int) -> None:
        src = self.sources[k % len(self.sources)]
        getattr(self, "do_" + action)(src, k)

    def do_ready(self, src, k):
        src.gate.mark_ready(k % src.manifest.abi.num_layers)

    def do_send(self, src, k):
        ready = [c for c in src.ready_chunks() if src.credits.can_acquire(c.nbytes)]
        if ready and src.state in (TxnState.RESERVED, TxnState.TRANSFERRING):
            frame = src.begin_send(ready[0].chunk_id)
            self._copy(src, ready[0])
            src.mark_sent(frame)
            self.net.append(frame)

    def _copy(self, src, spec):
        copy_chunk(src.raw, src.chunk_src_blocks(spec), self.world.endpoint.raw, src.manifest.chunk_dst_blocks(spec), spec.layer)

    def _deliver(self, frame):
        self.back.extend(self.world.endpoint.handle(frame))

    def do_deliver(self, src, k):
        if self.net:
            self._deliver(self.net.pop(k % len(self.net)))

    def do_dup(self, src, k):
        if self.net:
            self._deliver(self.net[k % len(self.net)])

    def do_drop(self, src, k):
        if self.net:
            self.net.pop(k % len(self.net))

    def do_corrupt(self, src, k):
        """Corrupt an in-flight chunk's bytes, as a byte-stream landing would (only unaccepted chunks land)."""
        frames = [f for f in self.net if isinstance(f, ChunkFrame) and self._landable(f)]
        if frames:
            frame = frames[k % len(frames)]
            blocks = self.world.endpoint.landing_blocks(frame)
            chunk_views(self.world.endpoint.raw, frame.layer, blocks)[0][k % 7] ^= 0x5A

    def _landable(self, frame):
        return self.world.endpoint.landing_blocks(frame) is not None

    def do_answer(self, src, k):
        if not self.back:
            return
        answer = self.back.pop(k % len(self.back))
        owner = next(s for s in self.sources if s.manifest.transfer_id == answer.transfer_id)
        if owner.state is TxnState.ABORTED:
            return  # late answer to an abandoned attempt: fenced by the source's terminal state
        deliver(owner, [answer])

    def do_seal(self, src, k):
        if src.all_sent() and src.state is TxnState.TRANSFERRING:
            self.net.append(src.seal())

    def do_resend(self, src, k):
        if src.state not in (TxnState.RESERVED, TxnState.TRANSFERRING):
            return
        self.net.append(ManifestFrame(src.manifest))
        for cid in list(src.resend_queue) + src.unacknowledged()[:1]:
            try:
                frame = src.resend_frame(cid, resend=1)
            except HandoffError as err:
                assert err.reason in (RejectReason.RETRIES_EXHAUSTED, RejectReason.ILLEGAL_TRANSITION)
                continue
            self._copy(src, src.manifest.chunk(cid))
            self.net.append(frame)
        src.resend_queue.clear()

    def do_abort_src(self, src, k):
        if src.state not in (TxnState.PUBLISHED, TxnState.ABORTED):
            self.net.append(src.abort(RejectReason.CANCELLED))

    def do_abort_dst(self, src, k):
        txn = self.world.endpoint.transfers[src.manifest.transfer_id]
        if txn.state < TxnState.PUBLISHED:
            self.world.endpoint.abort(txn.transfer_id, RejectReason.CANCELLED)

    def do_reroute(self, src, k):
        self.reroute()

    def check(self) -> None:
        world = self.world
        assert 0 <= world.credits.in_flight <= world.credits.capacity_bytes
        owners = world.endpoint.directory.owners()
        assert set(owners) <= {"req-1"}
        for txn in world.endpoint.transfers.values():
            if txn.state is TxnState.PUBLISHED and owners.get("req-1") == txn.transfer_id:
                assert txn.table.all_in(ChunkState.DEVICE_VISIBLE)
                assert txn.accepted == txn.seal.checksums
                assert published_bytes_equal(world, "req-1")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 64)), min_size=50, max_size=300), seed=st.integers(0, 3))
def test_random_interleavings_keep_invariants(steps, seed):
    world = make_world(credit_bytes=2048, seed=seed)
    model = Model(world)
    for action, k in steps:
        model.step(action, k)
        model.check()
    finish(world, *model.sources)


@settings(max_examples=60, deadline=None)
@given(order=st.permutations(list(range(9))), dups=st.lists(st.integers(0, 8), max_size=5))
def test_any_delivery_order_with_duplicates_publishes_exactly(order, dups):
    world = make_world(credit_bytes=1 << 20)
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    world.endpoint.handle(ManifestFrame(manifest))
    frames = []
    for spec in manifest.chunks:
        frame = src.begin_send(spec.chunk_id)
        copy_chunk(src.raw, src.chunk_src_blocks(spec), world.endpoint.raw, manifest.chunk_dst_blocks(spec), spec.layer)
        src.mark_sent(frame)
        frames.append(frame)
    assert len(frames) == 9
    for i in list(order) + dups:
        deliver(src, world.endpoint.handle(frames[i]))
    deliver(src, world.endpoint.handle(src.seal()))
    assert src.state is TxnState.PUBLISHED and published_bytes_equal(world, "req-1")
    finish(world, src)
