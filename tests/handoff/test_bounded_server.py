"""The handoff listeners' accept loop (handoff/transports/server.py): a connection limit with a
queue behind it, and no death on a transient accept error.

The EMFILE case runs a real decode-side `HandoffListener` in a child process whose descriptor
limit is then exhausted: a peer that connects meanwhile waits in the accept queue, and once
descriptors are free again the listener accepts it and answers (a connection that is not a
link that opens no known transfer is closed). A loop that exits on its first accept error never
answers.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

from pdserve.handoff.frames import AbortFrame, encode_frame
from pdserve.handoff.transports.channels import _LEN
from pdserve.handoff.transports.server import BoundedServer
from tests.helpers.sockets import closed_by_peer

CHILD = textwrap.dedent("""
    import errno, os, resource, sys, threading
    from tests.handoff.world import make_world
    from pdserve.workers.handoff_io import HandoffListener

    world = make_world()
    listener = HandoffListener(world.endpoint, threading.RLock(), "127.0.0.1", on_done=lambda *a: None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE
    print(listener.address[1], flush=True)
    sys.stdin.readline()  # two peers connected; the second accept has been failing with EMFILE
    for fd in held:
        os.close(fd)
    print(getattr(getattr(listener, "server", None), "num_accept_errors", -1), flush=True)
    sys.stdin.readline()
""")


def test_an_accept_loop_survives_emfile_and_accepts_once_descriptors_are_free():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        # the accept already waiting holds the descriptor it reserved: the first peer gets in; the
        # next accept finds none (EMFILE) while this peer's connection stays open
        first = socket.create_connection(("127.0.0.1", port), timeout=10)
        time.sleep(0.5)
        queued = socket.create_connection(("127.0.0.1", port), timeout=10)  # waits in the accept queue
        frame = encode_frame(AbortFrame("no-such-transfer", 1, "probe"))
        queued.sendall(b"T" + _LEN.pack(len(frame)) + frame)  # a link whose first frame opens nothing: closed
        time.sleep(0.5)
        child.stdin.write("\n")  # descriptors free again
        child.stdin.flush()
        errors = int(child.stdout.readline())
        queued.settimeout(10)
        try:
            answer = queued.recv(1)
        except socket.timeout:
            answer = None
        assert answer == b"", "the listener never accepted the queued peer"
        assert errors >= 1  # the accept did fail meanwhile, and the loop went on
        queued.close()
        first.close()
    finally:
        child.kill()
        child.wait(10)


def test_admitted_connections_past_the_limit_wait_for_a_slot_until_one_ends():
    release, served = threading.Event(), []

    def serve(conn: socket.socket, admit) -> None:
        byte = conn.recv(1)
        if admit():
            served.append(byte)
            release.wait(10)

    server = BoundedServer("127.0.0.1", serve, io_timeout_s=5.0, max_connections=2)
    peers = [socket.create_connection(server.address) for _ in range(3)]
    for i, peer in enumerate(peers):
        peer.sendall(bytes([65 + i]))
    deadline = time.monotonic() + 10
    while len(served) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(served) == 2  # the third waits: two slots are taken
    release.set()
    while len(served) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(served) == [b"A", b"B", b"C"]
    for peer in peers:
        peer.close()
    server.close()
    server.thread.join(5)
    assert not server.thread.is_alive()


def test_idle_peers_evict_one_another_and_never_block_a_peer_that_identifies_itself():
    """More silent peers than the accept queue and the slots together: before a peer names its
    transfer it holds only a pending place, the oldest of which each arrival takes over."""
    served = []

    def serve(conn: socket.socket, admit) -> None:
        byte = conn.recv(1)
        if byte == b"R" and admit():
            served.append(byte)
            conn.sendall(b"ok")

    server = BoundedServer("127.0.0.1", serve, io_timeout_s=30.0, max_connections=2, max_pending=4, backlog=4)
    idle = [socket.create_connection(server.address, timeout=10) for _ in range(40)]
    deadline = time.monotonic() + 10
    while server.num_evicted < 36 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.num_evicted == 36 and server.num_pending() == 4
    assert all(closed_by_peer(peer, 5.0) for peer in idle[:36])  # the oldest were shut down, not left hanging
    real = socket.create_connection(server.address, timeout=10)
    real.sendall(b"R")
    assert real.recv(2) == b"ok"  # admitted at once: the idle peers' 30 s timeout did not matter
    assert served == [b"R"] and server.num_evicted == 37
    for peer in idle + [real]:
        peer.close()
    server.close()
