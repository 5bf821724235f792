"""A bounded accept loop for handoff listeners: peers identify themselves before they hold a slot.

Contract: `BoundedServer(host, serve)` listens on an ephemeral port and runs `serve(conn, admit)`
on its own thread for each accepted connection. A connection starts *pending*: the peer has not
yet shown that it carries a transfer this worker expects. At most `max_pending` connections are
pending at once; a new arrival past that evicts the oldest pending one (its socket is shut down,
so its `serve` returns at once). `serve` calls `admit()` once the peer's first frame named a
known transfer: the connection leaves the pending set and takes one of `max_connections` service
slots (waiting up to one I/O timeout for one; False: evicted meanwhile, or no slot came free).
So idle or trickling peers can hold neither the accept queue nor the service slots: a flood of
them only evicts one another, and a real source, which sends its first frame right after
connecting, is admitted. Every accepted socket is tuned (buffers, TCP keepalive) and gets the
read/write timeout `io_timeout_s` before `serve` sees it. A transient accept error (EMFILE,
ENFILE, ENOBUFS, ECONNABORTED...) is counted and retried after a short backoff; only `close()`
ends the loop.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable

from pdserve.handoff.transports.tcp import tune

log = logging.getLogger("pdserve.handoff")

MAX_CONNECTIONS = 64  # admitted links (each carries a transfer the worker reserved blocks for)
MAX_PENDING = 32  # connections whose first frame has not named a known transfer yet
BACKLOG = 128
_BACKOFF_S = (0.01, 0.05, 0.1, 0.25, 0.5)

Admit = Callable[[], bool]


class BoundedServer:
    def __init__(self, host: str, serve: Callable[[socket.socket, Admit], None], io_timeout_s: float | None,
                 max_connections: int = MAX_CONNECTIONS, max_pending: int = MAX_PENDING, backlog: int = BACKLOG,
                 name: str = "handoff-listener"):
        self.serve, self.io_timeout_s, self.max_pending = serve, io_timeout_s, max_pending
        self.sock = socket.create_server((host, 0), backlog=backlog)
        self.address = (host, self.sock.getsockname()[1])
        self.slots = threading.BoundedSemaphore(max_connections)
        self.lock = threading.Lock()
        self.pending: OrderedDict[int, socket.socket] = OrderedDict()  # arrival order: the oldest goes first
        self.ids = itertools.count()
        self.num_accept_errors = self.num_evicted = 0
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept_loop, daemon=True, name=name)
        self.thread.start()

    def _accept_loop(self) -> None:
        failures = 0
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError as exc:
                if self.closed.is_set():
                    return
                self.num_accept_errors += 1
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                failures += 1
                log.warning("handoff listener %s: accept failed (%r), retrying in %.2f s", self.address, exc, delay)
                self.closed.wait(delay)
                continue
            failures = 0
            self._start(conn)

    def _start(self, conn: socket.socket) -> None:
        key = next(self.ids)
        with self.lock:
            if len(self.pending) >= self.max_pending:
                _, oldest = self.pending.popitem(last=False)
                self.num_evicted += 1
                _shut(oldest)  # its serve thread reads EOF (or an error) and returns
            self.pending[key] = conn
        try:
            tune(conn).settimeout(self.io_timeout_s)
            threading.Thread(target=self._run, args=(key, conn), daemon=True).start()
        except (OSError, RuntimeError) as exc:  # no thread or a dead socket: drop this peer, keep accepting
            log.warning("handoff listener %s: connection dropped (%r)", self.address, exc)
            with self.lock:
                self.pending.pop(key, None)
            conn.close()

    def _run(self, key: int, conn: socket.socket) -> None:
        admitted = False

        def admit() -> bool:
            nonlocal admitted
            with self.lock:
                if self.pending.pop(key, None) is None:
                    return False  # evicted by a newer arrival before it identified itself
            admitted = self.slots.acquire(timeout=self.io_timeout_s or 60.0)
            return admitted

        try:
            self.serve(conn, admit)
        finally:
            with self.lock:
                self.pending.pop(key, None)
            conn.close()
            if admitted:
                self.slots.release()

    def num_pending(self) -> int:
        with self.lock:
            return len(self.pending)

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept
        except OSError:
            pass
        self.sock.close()


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
