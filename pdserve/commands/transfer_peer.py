"""The decode side of `pdserve bench-transfer`, run in its own (spawned) process like a real worker.

Contract: `serve(conn, abi, num_blocks, identity, public_key_hex)` owns a destination `KvPool`, a
`DecodeEndpoint` and two listeners (TCP loopback, Unix socket); it sends their addresses on `conn`,
then answers commands until "stop":
  ("accept", kind)                accept the source's persistent link of `kind` ("tcp", "shm" (pull),
                                  "staging", "raw")
  ("handoff", kind, req, digest, guarded)
                                  reserve `req`, reply the reservation, serve the transfer until it
                                  is terminal (guarded: its manifest's capability is checked first,
                                  as a worker's listener does, with the issuer's public key), reply
                                  ("done", state, per-layer digests or None), then retire the
                                  request (its blocks return to the pool)
  ("sink", nbytes)                raw-socket peer: recv_into a preallocated buffer, reply "done"
Imports stay inside `serve` so registering the CLI never loads torch.
"""

from __future__ import annotations

import os
import socket
import tempfile


def _listeners() -> tuple[socket.socket, socket.socket, str]:
    from pdserve.handoff.transports.tcp import listen_local

    path = os.path.join(tempfile.mkdtemp(prefix="pdbench-"), "frames.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(path)
    unix.listen(1)
    return listen_local(), unix, path


def serve(conn, abi, num_blocks: int, identity, public_key_hex: str | None = None) -> None:
    from pdserve.engine.kv.kv_pool import KvPool
    from pdserve.handoff.trust.capability import verifier_from_hex
    from pdserve.handoff.endpoint import DecodeEndpoint
    from pdserve.handoff.reservations import PooledDestinationBlocks
    from pdserve.handoff.trace import NullSink

    pool = KvPool(abi, num_blocks)
    endpoint = DecodeEndpoint("d0", 1, pool, PooledDestinationBlocks(num_blocks), identity, trace=NullSink())
    verifier = verifier_from_hex(public_key_hex)
    tcp, unix, path = _listeners()
    conn.send((tcp.getsockname(), path))
    links, raw, sink = {}, None, None
    try:
        while (msg := conn.recv())[0] != "stop":
            if msg[0] == "accept":
                if msg[1] == "raw":
                    raw = _accept(tcp)
                else:
                    links[msg[1]] = _receiver(msg[1], tcp, unix, endpoint)
                conn.send("ok")
            elif msg[0] == "handoff":
                _handoff(conn, endpoint, links[msg[1]], msg[2], msg[3], verifier if msg[4] else None, msg[1])
            elif msg[0] == "sink":
                sink = sink if sink is not None and sink.size == msg[1] else _touched(msg[1])
                _sink(raw, sink)
                conn.send("done")
    finally:
        for link in links.values():
            link.close()
        for sock in (tcp, unix) + ((raw,) if raw else ()):
            sock.close()
        os.unlink(path)
        pool.close()


def _accept(server: socket.socket) -> socket.socket:
    from pdserve.handoff.transports.tcp import tune

    sock, _ = server.accept()
    return tune(sock) if sock.family == socket.AF_INET else sock


def _receiver(kind: str, tcp: socket.socket, unix: socket.socket, endpoint):
    from pdserve.handoff.transports.channels import SocketChannel
    from pdserve.handoff.transports.copy import ShmReceiverLink
    from pdserve.handoff.transports.pull import ShmPullReceiverLink
    from pdserve.handoff.transports.tcp import TcpReceiverLink

    if kind == "shm":
        return ShmPullReceiverLink(SocketChannel(_accept(unix)), endpoint.raw)
    if kind == "staging":
        return ShmReceiverLink(SocketChannel(_accept(unix)), endpoint.raw)
    return TcpReceiverLink(_accept(tcp), endpoint.raw)


def _handoff(conn, endpoint, link, request, want_digest: bool, verifier, kind: str) -> None:
    from pdserve.handoff.trust.capability import PULL, PUSH
    from pdserve.handoff.driver import DriveConfig, serve_destination
    from pdserve.handoff.trust.guard import LinkGuard
    from pdserve.handoff.kvbytes import chunk_checksum

    reservation = endpoint.reserve(request)
    conn.send((reservation.reservation_id, reservation.prompt_blocks))
    guard = None if verifier is None else LinkGuard(verifier, endpoint, request.transfer_id, PULL if kind == "shm" else PUSH)
    state = serve_destination(endpoint, link, request.transfer_id, DriveConfig(ack_timeout_s=2.0), guard=guard)
    digests = None
    if want_digest and state.name == "PUBLISHED":
        blocks = list(endpoint.directory.lookup(request.request_id).block_table)
        digests = [chunk_checksum(endpoint.raw, layer, blocks) for layer in range(endpoint.pool.abi.num_layers)]
    conn.send(("done", state.name, digests))
    if state.name == "PUBLISHED":
        endpoint.retire(request.request_id)  # the record goes with the handle
    endpoint.release(request.transfer_id)  # an aborted one's record


def _touched(nbytes: int):
    import numpy as np

    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)  # fault the pages in now, not inside a timed receive
    return buf


def _sink(sock: socket.socket, buf) -> None:
    view = memoryview(buf).cast("B")
    while len(view):
        view = view[sock.recv_into(view) :]
