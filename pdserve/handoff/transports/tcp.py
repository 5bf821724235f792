"""TCP transport: a small header frame, then the chunk's bytes, on one stream per (source, destination).

Contract: the sender writes the header and the chunk's pool views in one scatter-gather call
(no staging copy); the receiver asks the protocol where the chunk may land and `recv_into`s the
bytes straight into those destination blocks, or drains them into scratch when the chunk is
fenced, unknown or already accepted. Chunks are sized by the manifest (~1 MiB each).
"""

from __future__ import annotations

import socket

import numpy as np

from pdserve.handoff.frames import ChunkFrame, Frame
from pdserve.handoff.kvbytes import chunk_views
from pdserve.handoff.limits import UNSIZED, LinkLimits
from pdserve.handoff.transports.base import ChunkPayload, Landing, ReceiverLink, SenderLink
from pdserve.handoff.transports.channels import SocketChannel

_SOCKET_BUFFER_BYTES = 4 << 20


_KEEPALIVE = (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3))  # a dead host is noticed in ~11 s


def tune(sock: socket.socket) -> socket.socket:
    """Large buffers, and keepalive so a peer host that vanished ends the link."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER_BYTES)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock


class TcpSenderLink(SenderLink):
    def __init__(self, sock: socket.socket, limits: LinkLimits = UNSIZED):
        super().__init__()
        self.channel = SocketChannel(tune(sock), limits)

    def send(self, frame: Frame) -> None:
        self.traffic.record(header_bytes=self.channel.send_frame(frame), num_frames=1)

    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None:
        views = chunk_views(payload.src_raw, payload.layer, list(payload.src_blocks))
        header = self.channel.send_frame(frame, views)
        self.traffic.record(header_bytes=header, payload_bytes=frame.nbytes, num_frames=1,
                            retry_bytes=frame.nbytes if frame.resend else 0)

    def recv(self, timeout_s: float) -> Frame | None:
        return self.channel.recv_frame(timeout_s)

    def close(self) -> None:
        self.channel.close()


class TcpReceiverLink(ReceiverLink):
    def __init__(self, sock: socket.socket, dst_raw: np.ndarray, limits: LinkLimits = UNSIZED):
        super().__init__()
        self.channel = SocketChannel(tune(sock), limits)
        self.dst_raw = dst_raw

    def recv(self, timeout_s: float, landing: Landing) -> Frame | None:
        frame = self.channel.recv_frame(timeout_s)
        if isinstance(frame, ChunkFrame):
            self.channel.check_payload(frame.nbytes)  # before any grant: an absurd size ends the link
            blocks = landing(frame)
            if blocks is None:
                self.channel.discard(frame.nbytes)
            else:
                self.channel.recv_into_views(chunk_views(self.dst_raw, frame.layer, blocks))
            self.traffic.record(payload_bytes=frame.nbytes, num_frames=1)
        return frame

    def send(self, frame: Frame) -> None:
        self.channel.send_frame(frame)

    def close(self) -> None:
        self.channel.close()


def listen_local(host: str = "127.0.0.1") -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tune(server)
    server.bind((host, 0))
    server.listen(1)
    return server


def connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tune(sock)
    sock.connect(address)
    return sock
