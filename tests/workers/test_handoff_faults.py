"""A worker's handoff threads (workers/handoff_io.py) under link faults, in-process over real
sockets: every failure ends the transfer on the side that sees it and is reported through that
side's `on_done` (which the worker turns into a TransferDone for the router; the router then tells
the other side to abort: tests/router/process/test_router_recovery.py). Faults come from test-only
subclasses, never from the production path: a source whose link cannot open, a listener that
hangs up at once, a source whose link stalls after the manifest.
"""

from __future__ import annotations

import queue
import socket
import threading

import pytest

from pdserve.handoff.errors import RejectReason
from pdserve.handoff.frames import ManifestFrame
from pdserve.handoff.states import TxnState
from pdserve.workers.handoff_io import HandoffListener, HandoffSender, prompt_digest
from pdserve.workers.messages import TransferPlan
from tests.handoff.world import ABI, IDENTITY, make_world, reserve_request

PROMPT = tuple(range(3, 25))  # 22 tokens: two blocks


class UnreachableSender(HandoffSender):
    def _open_link(self, plan, window):
        raise ConnectionRefusedError("fault: no route to the destination")


class RefusingListener(HandoffListener):
    def _serve(self, conn: socket.socket, admit) -> None:  # BoundedServer passes admit (unused: it refuses)
        conn.close()


class StalledLink:
    """Forwards the manifest, then swallows every later frame and chunk: the link stalls."""

    def __init__(self, inner):
        self.inner, self.traffic = inner, inner.traffic

    def send(self, frame) -> None:
        if isinstance(frame, ManifestFrame):
            self.inner.send(frame)

    def send_chunk(self, frame, payload) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


class StalledSender(HandoffSender):
    def _open_link(self, plan, window):
        return StalledLink(super()._open_link(plan, window))


@pytest.fixture
def world():
    w = make_world(num_tokens=len(PROMPT))
    yield w
    w.close()


def open_pair(world, sender_cls=HandoffSender, listener_cls=HandoffListener, give_up_s: float = 30.0):
    done: queue.Queue = queue.Queue()
    lock = threading.RLock()
    listener = listener_cls(world.endpoint, lock, "127.0.0.1", on_done=lambda tid, state, _txn: done.put(("destination", tid, state)),
                            give_up_s=give_up_s)
    sender = sender_cls("prefill-0", 3, world.src_pool, IDENTITY, world.trace,
                        on_done=lambda rid, src, dt, phys: done.put(("source", rid, src)))
    request = reserve_request(world, num_tokens=len(PROMPT))
    request = type(request)(**{**request.__dict__, "prompt_digest": prompt_digest(PROMPT)})
    with lock:
        reservation = world.endpoint.reserve(request)
    plan = TransferPlan(request.transfer_id, request.generation, request.attempt, request.tenant, world.endpoint.worker,
                        world.endpoint.epoch, reservation.reservation_id, tuple(reservation.prompt_blocks), 0, "tcp",
                        listener.address)
    return sender, listener, plan, request, done


def start(sender, plan, request, world) -> None:
    sender.start(request.request_id, PROMPT, world.src_blocks, plan, request.tenant, "serialized")
    gate = sender.gate(request.request_id)
    if gate is not None:
        gate.mark_all_ready()


def test_a_healthy_link_publishes(world):
    sender, listener, plan, request, done = open_pair(world)
    start(sender, plan, request, world)
    ends = {done.get(timeout=30)[0]: None for _ in range(2)}
    assert set(ends) == {"source", "destination"}
    assert world.endpoint.transfers[plan.transfer_id].state is TxnState.PUBLISHED
    listener.close()


@pytest.mark.parametrize("sender_cls, listener_cls", [(UnreachableSender, HandoffListener),
                                                      (HandoffSender, RefusingListener)])
def test_a_link_that_cannot_open_or_is_refused_ends_the_source_with_a_report(world, sender_cls, listener_cls):
    sender, listener, plan, request, done = open_pair(world, sender_cls, listener_cls)
    start(sender, plan, request, world)
    side, rid, src = done.get(timeout=30)
    assert (side, rid, src.state, src.terminal_reason) == ("source", request.request_id, TxnState.ABORTED,
                                                           RejectReason.TRANSPORT_FAILURE)
    assert sender.gate(request.request_id) is None  # the sender forgot it: its blocks may be released
    # the destination never heard of it: its reservation waits for the router's Abort
    assert world.endpoint.transfers[plan.transfer_id].state is TxnState.RESERVED
    listener.close()


def test_a_stalled_link_ends_both_sides_each_with_a_report(world):
    sender, listener, plan, request, done = open_pair(world, StalledSender, give_up_s=0.5)
    start(sender, plan, request, world)
    # the listener gives up on the silent link and the source's acks time out; on a loaded machine
    # either may report first, so the two reports are taken in any order
    ends = dict(done.get(timeout=30)[0::2] for _ in range(2))
    assert ends["destination"] is TxnState.ABORTED
    assert ends["source"].state is TxnState.ABORTED
    assert world.endpoint.transfers[plan.transfer_id].state is TxnState.ABORTED
    listener.close()
