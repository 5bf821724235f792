"""The fetch control thread: a worker's prefix-fetch messages, handled off the engine-step thread.

Contract: `fetch_control_loop(worker)` runs on its own thread with its own socket (routing id
`<worker id>#fetch`, the worker's CURVE key, like the heartbeat socket: workers/heartbeat.py).
The router sends FetchReserve, FetchPin, FetchServe and FetchAbort there (router/kv/fetch_runner.py,
falling back to the worker's main socket while this one is not connected); each is handled by the
worker's current `FetchSide.handle` (workers/prefix_fetch/fetch.py), which takes only the worker lock, and the
reply goes back on this socket. The engine releases that lock during every model forward, so a
holder or destination in the middle of a long step answers a fetch within one forward's
bookkeeping instead of after the step (and its queued messages). Messages this thread cannot
decode, or that are not fetch messages, are dropped and logged. The thread ends with the worker.
"""

from __future__ import annotations

import logging

import zmq

from pdserve.engine.errors import EngineError
from pdserve.workers import messages as m
from pdserve.workers.control_keys import secure

log = logging.getLogger("pdserve.worker")
FETCH_SUFFIX = "#fetch"  # the routing id suffix of a worker's fetch socket (router/process/control_auth.py)
FETCH_MESSAGES = (m.FetchReserve, m.FetchPin, m.FetchServe, m.FetchAbort)
POLL_MS = 50  # how often the thread looks at `worker.running`


def fetch_socket(worker) -> zmq.Socket:
    """The fetch thread's socket, connected (call before the worker registers, so the router can
    reach it by the time it plans a fetch)."""
    sock = worker.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{worker.id}{FETCH_SUFFIX}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    secure(sock, worker.control_keys)  # the same CURVE key as the worker's main socket
    sock.connect(worker.config.router_address)
    return sock


def fetch_control_loop(worker, sock: zmq.Socket) -> None:
    """Handle fetch messages until the worker stops; `sock` is this thread's alone."""
    try:
        while worker.running:
            if not sock.poll(POLL_MS):
                continue
            reply = handle_frame(worker, sock.recv())
            if reply is not None:
                sock.send(m.encode(reply))
    finally:
        sock.close()


def handle_frame(worker, frame: bytes) -> m.ToRouter | None:
    """One frame from the router: the fetch side's reply, or None."""
    try:
        msg = m.decode_to_worker(frame)
    except Exception:  # noqa: BLE001 - msgspec raises several kinds; a bad frame must not end the thread
        log.warning("worker %s: undecodable message on the fetch socket dropped", worker.id)
        return None
    if not isinstance(msg, FETCH_MESSAGES):
        log.warning("worker %s: %s on the fetch socket dropped", worker.id, type(msg).__name__)
        return None
    try:
        with worker.lock:  # a role switch rebuilds the fetch side under it (the side takes it again: an RLock)
            return worker.fetch.handle(msg)
    except (EngineError, ValueError, KeyError) as exc:
        log.warning("worker %s: %s failed: %r", worker.id, type(msg).__name__, exc)
        return None
