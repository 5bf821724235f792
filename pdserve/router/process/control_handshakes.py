"""Which connections to the router's control socket failed their handshake, judged from the socket
monitor's events: one count per failed connection, none for a worker's.

Contract: libzmq (4.3, as pyzmq ships it; `tests/router/process/test_control_handshakes.py` checks each
case on a real socket) reports an accepted TCP connection as `ACCEPTED(fd)`, then one outcome,
then `DISCONNECTED(fd)` when it closes:
    HANDSHAKE_SUCCEEDED         CURVE with a key the ZAP handler admitted (a worker)
    HANDSHAKE_FAILED_PROTOCOL   a ZMTP peer with another mechanism (a plain zmq client), or bad
                                CURVE cryptography
    HANDSHAKE_FAILED_AUTH       the ZAP handler refused the key
    HANDSHAKE_FAILED_NO_DETAIL  closed, or silent past the handshake interval, mid-handshake
    (nothing)                   a peer that does not speak ZMTP 3 (HTTP, any bytes not starting
                                with 0xff), or a frame over ZMQ_MAXMSGSIZE before the handshake
A failed handshake's `DISCONNECTED` follows its failure event at once, and libzmq ends every
handshake within the socket's handshake interval (ZMQ_HANDSHAKE_IVL, 30 s): a connection still
open after it has passed its handshake. `HandshakeTally` judges each connection once, when it
closes: failed unless it completed the handshake. So a peer counts once per connection it opened
(a zmq client that reconnects opens one per attempt).

The outcome events carry no descriptor, so a success is not tied to a connection. A close that
no failure event announced is judged by age: older than the interval, a worker's; younger, a
failure unless the other open connections cannot all be the successful ones. That is exact at
every close while each worker connection lives longer than the interval (rogues then come and
go in any order), and for any connections whose handshakes do not overlap; a worker connection
that closes within the interval while another handshake is under way may be counted.
"""

from __future__ import annotations

import zmq

FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MONITOR_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class HandshakeTally:
    def __init__(self, handshake_s: float = 30.0) -> None:
        """`handshake_s`: the socket's handshake interval (0: none, every handshake may last)."""
        self.handshake_s = handshake_s if handshake_s > 0 else float("inf")
        self.open: dict[int, float] = {}  # descriptor -> when its connection was accepted (not closed yet)
        self.succeeded = 0  # open connections that completed the handshake (which ones is not known)
        self.failing = 0  # failure events whose connection has not closed yet

    def on_event(self, event: int, value: int, now: float) -> int:
        """How many failed connections `event` (with its value: the descriptor, where it has one)
        ends at `now` (seconds, any monotonic clock): 0 or 1."""
        if event == zmq.EVENT_ACCEPTED:
            self.open.pop(value, None)  # the descriptor's last connection closed unseen (a dropped event)
            self.open[value] = now
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded += 1
        elif event in FAILURES:
            self.failing += 1
        elif event == zmq.EVENT_DISCONNECTED and value in self.open:
            return self._closed(now - self.open.pop(value))
        self._bound()
        return 0

    def _closed(self, age_s: float) -> int:
        if self.failing:  # the failure event just before it was this connection's
            self.failing -= 1
            failed = 1
        elif age_s > self.handshake_s or self.succeeded > len(self.open) - self.failing:
            self.succeeded = max(0, self.succeeded - 1)  # past its handshake, or the others cannot hold every success
            failed = 0
        else:
            failed = 1
        self._bound()
        return failed

    def _bound(self) -> None:
        """Successes and pending failures are connections among the open ones."""
        self.failing = min(self.failing, len(self.open))
        self.succeeded = min(self.succeeded, len(self.open) - self.failing)
