"""TCP streams whose received bytes carry the kernel's arrival time, on the running event loop.

Why: a timestamp taken when the event loop gets round to a readable socket includes the loop's
own lag (other callbacks, a collection, the other process sharing the core). With a few hundred
streams per second on two cores that lag is most of the benchmark's TTFT error. Linux stamps
every received segment in the kernel (SO_TIMESTAMPNS), and recvmsg returns the stamp of the last
segment it consumed, so a byte's time no longer depends on when Python reads it.

Contract:
- `recv_stamped(sock, size)` -> ``(data, stamp_s)``: one recvmsg; `stamp_s` is in
  `time.perf_counter()` seconds: the kernel's stamp when one came with the data, else the time of
  the read. A read that drains several segments gets the last one's stamp, so a stamp is never
  earlier than the true arrival of the bytes it covers. The kernel turns stamping on shortly
  after the first socket asks (from a work queue), so the very first segments of a process may
  come unstamped and fall back to the read time.
- `StampedStream(sock, on_data, on_lost)`: registers a connected socket with the running loop
  and turns stamping on (`kernel_stamps` says whether the platform has it). Every read calls
  ``on_data(stamp_s, data)``; end of stream or a socket error calls ``on_lost()`` once. `write`
  sends now and buffers what the socket did not take; `drain` waits until the buffer is empty;
  `close` unregisters and closes (without calling `on_lost`). TCP_NODELAY is set: streamed
  tokens are small writes that must leave at once.
- `connect(host, port, on_data, on_lost)` opens a client stream.
"""

from __future__ import annotations

import asyncio
import platform
import socket
import struct
import sys
import time
from collections.abc import Callable

# Python's socket module does not export SO_TIMESTAMPNS; Linux's value is 35 on the common
# architectures (asm-generic), and other values where an architecture defines its own.
_LINUX_GENERIC = ("x86_64", "aarch64", "arm64", "armv7l", "riscv64", "ppc64le", "s390x", "i686")
SO_TIMESTAMPNS: int | None = getattr(socket, "SO_TIMESTAMPNS", None)
if SO_TIMESTAMPNS is None and sys.platform == "linux" and platform.machine() in _LINUX_GENERIC:
    SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@ll")  # struct timespec: tv_sec, tv_nsec (native longs)
_ANC_SIZE = socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(socket, "CMSG_SPACE") else 0
READ_SIZE = 256 * 1024


def enable_stamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp this socket's received data; False where it cannot."""
    if SO_TIMESTAMPNS is None or not _ANC_SIZE:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def recv_stamped(sock: socket.socket, size: int = READ_SIZE) -> tuple[bytes, float]:
    """One read and its arrival time in perf_counter seconds (see the module contract)."""
    if not _ANC_SIZE:
        return sock.recv(size), time.perf_counter()
    data, ancdata, _, _ = sock.recvmsg(size, _ANC_SIZE)
    now_perf_ns = time.perf_counter_ns()
    now_real_ns = time.time_ns()
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(payload)
            waited_ns = max(0, now_real_ns - (sec * 1_000_000_000 + nsec))  # a clock step never goes negative
            return data, (now_perf_ns - waited_ns) / 1e9
    return data, now_perf_ns / 1e9


class StampedStream:
    """One connected TCP socket on the running loop, with stamped reads (see module contract)."""

    def __init__(
        self, sock: socket.socket, on_data: Callable[[float, bytes], None], on_lost: Callable[[], None]
    ) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.kernel_stamps = enable_stamps(sock)
        self.closed = False
        self._sock = sock
        self._fd = sock.fileno()
        self._on_data = on_data
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._out = bytearray()
        self._drained: asyncio.Future | None = None
        self._loop.add_reader(self._fd, self._readable)

    def write(self, data: bytes) -> None:
        """Send `data` now; what the socket does not take is sent when it becomes writable."""
        if self.closed:
            raise ConnectionError("write on a closed stream")
        if not self._out:
            data = data[self._send(data):]
            if not data or self.closed:
                return
            self._loop.add_writer(self._fd, self._writable)
        self._out += data

    async def drain(self) -> None:
        """Wait until every written byte is in the kernel; ConnectionError if the stream died."""
        while self._out and not self.closed:
            self._drained = self._loop.create_future()
            await self._drained
        if self.closed:
            raise ConnectionError("stream closed")

    def close(self) -> None:
        """Unregister and close the socket; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        if self._out:
            self._loop.remove_writer(self._fd)
            self._out.clear()
        self._sock.close()
        self._wake_drain()

    def _readable(self) -> None:
        while not self.closed:
            try:
                data, stamp_s = recv_stamped(self._sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._lose()
                return
            if not data:
                self._lose()
                return
            self._on_data(stamp_s, data)

    def _writable(self) -> None:
        sent = self._send(self._out)  # the buffer itself: no copy of what is still queued
        del self._out[:sent]
        if not self._out and not self.closed:
            self._loop.remove_writer(self._fd)
            self._wake_drain()

    def _send(self, data: bytes | bytearray) -> int:
        try:
            return self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self._lose()
            return 0

    def _lose(self) -> None:
        if not self.closed:
            self.close()
            self._on_lost()

    def _wake_drain(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


async def connect(
    host: str, port: int, on_data: Callable[[float, bytes], None], on_lost: Callable[[], None]
) -> StampedStream:
    """Open a TCP connection to (host, port) as a StampedStream."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return StampedStream(sock, on_data, on_lost)
