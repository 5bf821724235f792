"""Socket checks the handoff tests share."""

from __future__ import annotations

import socket


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True when the peer closed (EOF or reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
