"""Frame channels: an in-process queue pair and a length-prefixed socket stream.

Contract: a channel carries whole frames in order. `SocketChannel` writes a 4-byte length, the
msgpack header and then any payload views in one scatter-gather `sendmsg` (no concatenation),
and reads payloads with `recv_into` straight into caller-provided views (the destination pool).
A closed peer raises `LinkClosed`, and so do a header longer than the channel's
`LinkLimits.max_header_bytes` (refused before anything is allocated) and a read or write that
stalls longer than its `io_timeout_s` (handoff/limits.py). A header is read in steps of
`_HEADER_STEP_BYTES`, so a peer that declares a large one and stalls holds only what it sent, and
`expect_within(s)` bounds every read until cleared by one total deadline: a listener gives an
unadmitted peer that long for its first frame, however it trickles the bytes.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import threading
import time

import msgspec
import numpy as np

from pdserve.handoff.frames import Frame, decode_frame, encode_frame
from pdserve.handoff.limits import UNSIZED, LinkLimits
from pdserve.handoff.transports.base import LinkClosed

_LEN = struct.Struct("<I")
_SCRATCH_BYTES = 1 << 20
_HEADER_STEP_BYTES = 64 << 10  # a header's buffer grows by this much per read step


class QueueChannel:
    """One direction of an in-process frame queue."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self.closed = False

    def put(self, frame: Frame) -> None:
        with self._cond:
            if self.closed:
                raise LinkClosed("queue closed")
            self._items.append(frame)
            self._cond.notify()

    def get(self, timeout_s: float) -> Frame | None:
        with self._cond:
            self._cond.wait_for(lambda: self._items or self.closed, timeout_s)
            if self._items:
                return self._items.popleft()
            if self.closed:
                raise LinkClosed("queue closed")
            return None

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class SocketChannel:
    """Frames over a connected stream socket (TCP or Unix)."""

    def __init__(self, sock: socket.socket, limits: LinkLimits = UNSIZED):
        self.sock, self.limits = sock, limits
        sock.settimeout(limits.io_timeout_s)  # a stalled peer ends the link (LinkClosed), never blocks it for good
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._scratch: bytearray | None = None  # drains refused payloads; made on first use
        self._deadline: float | None = None  # monotonic time every read must be done by (expect_within)

    def expect_within(self, seconds: float | None) -> None:
        """Until called again with None, every read ends the link unless it is done `seconds` from
        now in total (a per-call socket timeout alone lets a peer trickle a byte per timeout)."""
        self._deadline = None if seconds is None else time.monotonic() + seconds
        if seconds is None:
            self.sock.settimeout(self.limits.io_timeout_s)

    def send_frame(self, frame: Frame, views: list[np.ndarray] = ()) -> int:
        """Send header (+ payload views); returns header bytes on the wire."""
        header = encode_frame(frame)
        buffers = [_LEN.pack(len(header)) + header] + [memoryview(v).cast("B") for v in views]
        self._sendmsg_all(buffers)
        return _LEN.size + len(header)

    def _sendmsg_all(self, buffers: list) -> None:
        try:
            while buffers:
                sent = self.sock.sendmsg(buffers[:64])
                while buffers and sent >= len(buffers[0]):
                    sent -= len(buffers[0])
                    buffers.pop(0)
                if sent:
                    buffers[0] = memoryview(buffers[0])[sent:]
        except (BrokenPipeError, ConnectionResetError, OSError) as err:
            raise LinkClosed(str(err)) from err

    def recv_frame(self, timeout_s: float) -> Frame | None:
        if self._deadline is not None:
            timeout_s = max(0.0, min(timeout_s, self._deadline - time.monotonic()))
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        if not ready:
            return None
        size = bytearray(_LEN.size)
        self._recv_exact(memoryview(size))
        nbytes = _LEN.unpack(size)[0]
        if nbytes > self.limits.max_header_bytes:  # refused before a byte of it is allocated
            raise LinkClosed(f"frame header of {nbytes} B over the link's bound of {self.limits.max_header_bytes} B")
        header = bytearray()
        while len(header) < nbytes:  # grows with what arrives: a declared size alone allocates nothing
            part = bytearray(min(nbytes - len(header), _HEADER_STEP_BYTES))
            self._recv_exact(memoryview(part))
            header += part
        try:
            return decode_frame(header)
        except msgspec.DecodeError as err:  # a malformed frame ends the link like a dead peer
            raise LinkClosed(f"malformed frame: {err}") from err

    def recv_into_views(self, views: list[np.ndarray]) -> None:
        for v in views:
            self._recv_exact(memoryview(v).cast("B"))

    def check_payload(self, nbytes: int) -> None:
        """A chunk payload larger than any chunk of this pool can be ends the link unread."""
        if not 0 <= nbytes <= self.limits.max_payload_bytes:
            raise LinkClosed(f"chunk payload of {nbytes} B over the link's bound of {self.limits.max_payload_bytes} B")

    def discard(self, nbytes: int) -> None:
        self.check_payload(nbytes)
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH_BYTES)
        view = memoryview(self._scratch)
        while nbytes > 0:
            step = min(nbytes, len(view))
            self._recv_exact(view[:step])
            nbytes -= step

    def _recv_exact(self, view: memoryview) -> None:
        while len(view):
            if self._deadline is not None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise LinkClosed("peer too slow: its frame did not arrive in time")
                self.sock.settimeout(min(left, self.limits.io_timeout_s or left))
            try:
                n = self.sock.recv_into(view)
            except (ConnectionResetError, OSError) as err:
                raise LinkClosed(str(err)) from err
            if n == 0:
                raise LinkClosed("peer closed the connection")
            view = view[n:]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
