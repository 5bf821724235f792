"""The fetch control thread (workers/prefix_fetch/fetch_control.py): a worker answers the router's fetch
messages on its own `#fetch` socket while its main loop does not poll (as during an engine step),
and drops what is not a fetch message there."""

from __future__ import annotations

import threading
import time

import zmq

from pdserve.engine.sequence import SamplingParams
from pdserve.workers import messages as m
from pdserve.workers.prefix_fetch.fetch_control import fetch_control_loop, fetch_socket
from tests.workers.prefix_fetch.test_prefix_fetch import Node, prompt


class ThreadedNode(Node):
    """A Node with what the fetch thread reads of a Worker: its zmq context, keys, router address."""

    def __init__(self, wid: str, router_address: str):
        super().__init__(wid)
        self.ctx, self.control_keys, self.running = zmq.Context.instance(), None, True
        self.config.router_address = router_address


def _send_when_connected(router: zmq.Socket, ident: bytes, msg, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            router.send_multipart([ident, m.encode(msg)])
            return
        except zmq.ZMQError:  # ROUTER_MANDATORY: the fetch socket has not connected yet
            assert time.monotonic() < deadline, "the fetch socket never connected"
            time.sleep(0.01)


def test_fetch_messages_are_answered_on_the_fetch_socket_while_the_main_loop_is_busy():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    holder = ThreadedNode("h", router.getsockopt_string(zmq.LAST_ENDPOINT))
    history = prompt(64, 3)
    holder.engine.generate([history], SamplingParams(max_tokens=2, ignore_eos=True))
    thread = threading.Thread(target=fetch_control_loop, args=(holder, fetch_socket(holder)), daemon=True)
    thread.start()
    try:  # this thread stands for the worker's main loop: it never polls the worker's sockets
        _send_when_connected(router, b"h#fetch", m.RenewLeases(("x",)))  # not a fetch message: dropped
        _send_when_connected(router, b"h#fetch", m.FetchPin("f1", tuple(history), "default", 4))
        assert router.poll(10_000), "no answer on the fetch socket"
        ident, body = router.recv_multipart()
        pinned = m.decode_to_router(body)
        assert ident == b"h#fetch" and isinstance(pinned, m.FetchPinned)
        assert (pinned.fetch_id, pinned.ok, len(pinned.src_slots)) == ("f1", True, 4)
        assert len(holder.fetch.tables()) == 1  # the four device blocks stay pinned for the fetch
        _send_when_connected(router, b"h#fetch", m.FetchAbort("f1"))
        deadline = time.monotonic() + 10
        while holder.fetch.tables():
            assert time.monotonic() < deadline, "FetchAbort never unpinned"
            time.sleep(0.01)
        assert not router.poll(200)  # the abort of a pinned, unserved fetch answers nothing; RenewLeases neither
        assert holder.sent == []  # nothing went out on the main socket
        holder.fetch.assert_no_leaks()
    finally:
        holder.running = False
        thread.join(timeout=5)
        holder.close()
        router.close()
    assert not thread.is_alive()
