"""Peers that declare much and send little, against a handoff channel and a listener.

* a frame header's declared length allocates nothing by itself: the channel's buffer grows with
  the bytes that arrive (a peer that claims a header near the bound and stalls holds only what it
  sent, not the bound, in each of the listener's 64 connections);
* a peer that trickles a byte per I/O timeout keeps a per-call socket timeout from ever firing;
  `expect_within` bounds the whole read, and a `HandoffListener` gives an unadmitted peer one I/O
  timeout for its first frame, so a slow-loris connection frees its slot and memory.
"""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import pytest

from pdserve.handoff.limits import LinkLimits
from pdserve.handoff.transports.base import LinkClosed
from pdserve.handoff.transports.channels import _LEN, SocketChannel
from pdserve.workers.handoff_io import HandoffListener
from tests.handoff.world import make_world

DECLARED = 32 << 20  # a header length under the bound, never sent in full


def _trickle(sock: socket.socket, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            sock.send(b"\x00")
        except OSError:
            return


def test_a_declared_header_allocates_only_the_bytes_that_arrived():
    ours, peer = socket.socketpair()
    channel = SocketChannel(ours, LinkLimits(64 << 20, 1 << 30, io_timeout_s=5.0))
    peer.sendall(_LEN.pack(DECLARED) + b"\x00" * 100)
    closer = threading.Timer(0.5, peer.close)  # the peer gives up 100 bytes in
    tracemalloc.start()
    try:
        closer.start()
        with pytest.raises(LinkClosed):
            channel.recv_frame(5.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        closer.join()
        channel.close()
    assert peak < 1 << 20, f"a 32 MiB header claim with 100 bytes sent allocated {peak >> 20} MiB"


def test_a_trickling_peer_misses_the_deadline_its_reads_are_held_to():
    ours, peer = socket.socketpair()
    channel = SocketChannel(ours, LinkLimits(64 << 20, 1 << 30, io_timeout_s=1.0))
    peer.sendall(_LEN.pack(1000))
    stop = threading.Event()
    threading.Thread(target=_trickle, args=(peer, stop, 0.2), daemon=True).start()  # well inside the timeout
    channel.expect_within(1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(LinkClosed):
            channel.recv_frame(1.0)
        # without the deadline the read lasts 1000 trickled bytes (200 s); with it, one deadline
        assert time.monotonic() - t0 < 30.0
    finally:
        stop.set()
        channel.close()
        peer.close()


def test_a_listener_closes_a_slow_loris_peer_before_its_first_frame():
    world = make_world()
    listener = HandoffListener(world.endpoint, threading.RLock(), "127.0.0.1", on_done=lambda *a: None,
                               io_timeout_s=1.0)
    peer = socket.create_connection(listener.address)
    peer.sendall(b"T" + _LEN.pack(1000))
    stop = threading.Event()
    threading.Thread(target=_trickle, args=(peer, stop, 0.2), daemon=True).start()
    try:
        peer.settimeout(30.0)
        try:
            closed = peer.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
        assert closed, "a peer trickling its first frame kept its connection (and slot) for 30 s"
    finally:
        stop.set()
        peer.close()
        listener.close()
