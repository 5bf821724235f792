"""The HTTP edge's connection limits enforced below the ASGI app: a cap on open connections,
deadlines for each request's head and body, and one for an answer that cannot move, so clients that
connect and then send slowly, or not at all, or never read, cannot hold the server's file descriptors.

Contract: `edge_protocol(limits)` is the uvicorn `http` protocol for `pdserve serve`: uvicorn's
h11 protocol with `EdgeLimits` (limits.py) enforced:
- a connection accepted while `max_connections` are already open answers 503 at once, before its
  request is read, and is closed;
- a request head (request line and headers) must be complete within `header_timeout_s` of the
  connection's opening, or of its first byte when it follows a response on a kept-alive
  connection; else 408 and close;
- a request body must be complete within `body_timeout_s` of its head; else 408 and close. The
  app's pending `receive` returns `http.disconnect`, so no route runs and nothing reaches the
  router. When the app already answered (a 401, or a route that reads no body) the connection is
  only closed;
- an answer the client does not read: while uvicorn has paused writing (its buffer past the
  high-water mark, the kernel's send buffer full), a `write_timeout_s` in which no byte of it left
  aborts the connection (close() would wait for the unread bytes forever); the app's blocked send
  returns and its disconnect watch aborts the request (nginx's `send_timeout`). A byte leaving
  counts whether it leaves uvicorn's buffer or the kernel's send queue (SIOCOUTQ: the kernel wakes
  the writer only once half its autotuned 4 MiB drained, which a client reading under ~35 KB/s
  never managed within 60 s), so a client that keeps reading, however slowly, keeps its answer, and
  one whose writes never pause never meets it.
Every answer is the OpenAI error body (api/errors.py) with `Connection: close`. An idle kept-alive
connection is closed after uvicorn's `timeout_keep_alive` (5 s), as before.
Why here: uvicorn 0.55 arms no timer on a fresh connection, cancels its keep-alive timer at the
first byte of the next head and never re-arms it, has no body deadline, and its
`limit_concurrency` answers only a connection whose head completed (a silent one holds its fd);
`h11_max_incomplete_event_size` bounds a head's bytes (16 KiB, then 400), not its time.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import struct
import termios
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.api.edge.limits import EdgeLimits
from pdserve.api.errors import ApiErrorInfo


def error_bytes(status: int, message: str, code: str, headers: tuple[str, ...] = ()) -> bytes:
    """A whole HTTP/1.1 answer with the OpenAI error body, written outside h11 (which cannot answer
    a request whose head it has not parsed)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(ApiErrorInfo(status, message, kind, code=code).body()).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class EdgeProtocol(H11Protocol):
    """h11's protocol with one deadline timer per connection (head or body, never both)."""

    limits: EdgeLimits = EdgeLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.phase: str | None = None  # "head" | "body" while a deadline runs
        self.refused = False
        self.stall: asyncio.TimerHandle | None = None  # armed while uvicorn paused writing (the client reads nothing)
        self.stall_left = 0  # bytes buffered when `stall` was armed

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:  # this one included
            self.refused = True
            self._answer(error_bytes(503, f"the server holds its limit of {self.limits.max_connections} connections "
                                          "(--max-connections); retry later", "too_many_connections",
                                     ("retry-after: 1",)))
            return
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.stall is None:
            self._arm_stall()

    def _arm_stall(self) -> None:
        self.stall_left = self._unsent()  # the app adds nothing while writes are paused
        self.stall = self.loop.call_later(self.limits.write_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def _unstall(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _stalled(self) -> None:
        """No byte of the answer left for write_timeout_s: drop the connection (abort: close() would
        wait for the unread bytes forever); the app sees a disconnect. Some left: the client reads,
        however slowly, and gets another write_timeout_s (nginx's send_timeout)."""
        self.stall = None
        if self._unsent() < self.stall_left:
            self._arm_stall()
            return
        self.transport.abort()

    def _unsent(self) -> int:
        """Bytes of the answer not yet taken by the client: uvicorn's buffer and the kernel's send
        queue (SIOCOUTQ). The kernel wakes a paused writer only once half its send buffer drained
        (~2 MiB autotuned), so a slow reader's progress shows in its queue long before the buffer's."""
        queued = 0
        sock = self.transport.get_extra_info("socket")
        outq = getattr(termios, "TIOCOUTQ", None)  # Linux's SIOCOUTQ; elsewhere uvicorn's buffer alone
        if sock is not None and outq is not None:
            with contextlib.suppress(OSError, ValueError):
                queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), outq, b"\0\0\0\0"))[0]
        return self.transport.get_write_buffer_size() + queued

    def _follow(self) -> None:
        """Arm, keep or drop the deadline for where the client's side of the exchange stands."""
        their = self.conn.their_state
        if their is h11.SEND_BODY:
            wanted = "body"
        elif their is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            wanted = "head"  # a first head, or bytes of the next one (uvicorn dropped its keep-alive timer)
        else:
            wanted = None  # body complete, or idle between requests (uvicorn's keep-alive timer)
        if wanted != self.phase:
            self._disarm()
            if wanted is not None:
                self._arm(wanted)

    def _arm(self, phase: str) -> None:
        timeout_s = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self.phase, self.deadline = phase, self.loop.call_later(timeout_s, self._late)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.phase = self.deadline = None

    def _late(self) -> None:
        phase, self.deadline = self.phase, None
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        if cycle is not None:  # the app's pending receive returns http.disconnect; its answer is dropped
            answered = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if answered:
                self.transport.close()
                return
        flag, limit = (("--request-header-timeout-s", self.limits.header_timeout_s) if phase == "head"
                       else ("--request-body-timeout-s", self.limits.body_timeout_s))
        self._answer(error_bytes(408, f"the request {phase} did not arrive within {limit:g} s ({flag})",
                                 "request_timeout"))

    def _answer(self, answer: bytes) -> None:
        self.transport.write(answer)
        self.transport.close()


def edge_protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` (uvicorn builds one per connection)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})

