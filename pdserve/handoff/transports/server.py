"""A bounded accept loop for handoff listeners: a connection limit, a queue, and no silent death.

Contract: `BoundedServer(host, serve)` listens on an ephemeral port and runs `serve(conn)` on its
own thread for each accepted connection, at most `max_connections` at a time; further peers wait
in the kernel's accept queue (`backlog`) until a connection ends. Every accepted socket is tuned
(buffers, TCP keepalive) and gets the read/write timeout `io_timeout_s` before `serve` sees it,
so a peer that stalls releases its slot within that bound. A transient accept error (EMFILE,
ENFILE, ENOBUFS, ECONNABORTED...) is counted and retried after a short backoff; only `close()`
ends the loop.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from pdserve.handoff.transports.tcp import tune

log = logging.getLogger("pdserve.handoff")

MAX_CONNECTIONS = 64
BACKLOG = 128
_BACKOFF_S = (0.01, 0.05, 0.1, 0.25, 0.5)


class BoundedServer:
    def __init__(self, host: str, serve: Callable[[socket.socket], None], io_timeout_s: float | None,
                 max_connections: int = MAX_CONNECTIONS, backlog: int = BACKLOG, name: str = "handoff-listener"):
        self.serve, self.io_timeout_s = serve, io_timeout_s
        self.sock = socket.create_server((host, 0), backlog=backlog)
        self.address = (host, self.sock.getsockname()[1])
        self.slots = threading.BoundedSemaphore(max_connections)
        self.num_accept_errors = 0
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept_loop, daemon=True, name=name)
        self.thread.start()

    def _accept_loop(self) -> None:
        failures = 0
        while not self.closed.is_set():
            if not self.slots.acquire(timeout=0.1):  # at the limit, new peers wait in the accept queue
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError as exc:
                self.slots.release()
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
        try:
            tune(conn).settimeout(self.io_timeout_s)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()
        except (OSError, RuntimeError) as exc:  # no thread or a dead socket: drop this peer, keep accepting
            log.warning("handoff listener %s: connection dropped (%r)", self.address, exc)
            conn.close()
            self.slots.release()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        finally:
            conn.close()
            self.slots.release()

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept
        except OSError:
            pass
        self.sock.close()
