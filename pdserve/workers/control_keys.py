"""A worker's CURVE key material for the router's control socket, and how it reaches the worker.

Contract: the router issues one `ControlKeys` per worker incarnation (router/process/control_auth.py):
the router's public server key and the worker's own client key pair, all Z85 text. The launcher
hands it over outside argv and outside the environment: `pipe_for(keys)` writes the keys into a
fresh pipe and closes its write end; the local worker process inherits the read end (`pass_fds`)
and finds its number in `PDSERVE_CONTROL_KEYS_FD`, which holds nothing secret. `from_env` reads
the keys once and closes the pipe, so after start-up they live only in the worker's memory: not in
/proc/PID/environ (a process's initial environment, which no later edit changes), not in an open
descriptor, and not in processes the worker starts (TP ranks). A Ray worker gets them as an
argument of its actor's constructor (workers/process/ray_launch.py). `secure(sock, keys)` makes a DEALER
a CURVE client of the router (before it connects).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

FD_ENV = "PDSERVE_CONTROL_KEYS_FD"  # the inherited pipe's descriptor number (not the keys)
_SEP = ","  # not in the Z85 alphabet


@dataclass(frozen=True)
class ControlKeys:
    server_public: bytes  # the router's CURVE public key (Z85)
    client_public: bytes  # this worker incarnation's key pair (Z85)
    client_secret: bytes

    def __repr__(self) -> str:  # the secret never reaches a log line
        return f"ControlKeys(server={self.server_public.decode()}, client={self.client_public.decode()})"

    def to_text(self) -> str:
        return _SEP.join(k.decode("ascii") for k in (self.server_public, self.client_public, self.client_secret))

    @staticmethod
    def from_text(text: str) -> ControlKeys:
        parts = text.split(_SEP)
        if len(parts) != 3 or any(len(p) != 40 for p in parts):
            raise ValueError("control keys: expected three Z85 keys of 40 characters")
        return ControlKeys(*(p.encode("ascii") for p in parts))


def pipe_for(keys: ControlKeys) -> int:
    """The read end of a pipe holding `keys` (write end closed): the child process inherits it.
    The caller closes it once the child started. 122 bytes fit any pipe's buffer: no write blocks."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, keys.to_text().encode("ascii"))
    finally:
        os.close(write_fd)
    return read_fd


def from_env() -> ControlKeys | None:
    """The keys the launcher handed this process through its pipe (read once, the pipe closed and
    its variable removed), or None when it handed none."""
    fd = os.environ.pop(FD_ENV, None)
    if fd is None:
        return None
    with os.fdopen(int(fd), "rb") as pipe:
        return ControlKeys.from_text(pipe.read().decode("ascii"))


def secure(sock: zmq.Socket, keys: ControlKeys | None) -> None:
    """Make `sock` a CURVE client of the router (no keys: a plain socket, which the router refuses)."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
