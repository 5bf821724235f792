"""A worker's CURVE key material for the router's control socket, and how it reaches the worker.

Contract: the router issues one `ControlKeys` per worker incarnation (router/process/control_auth.py):
the router's public server key and the worker's own client key pair, all Z85 text. The launcher
hands it over outside argv: in the environment variable `PDSERVE_CONTROL_KEYS` of a local worker
process (readable only by the same user, like a 0600 file; `ps` shows argv, not the environment),
or as an argument of the Ray actor's constructor (workers/ray_launch.py). `from_env` takes the
keys out of the environment, so processes the worker starts (TP ranks) do not inherit them.
`secure(sock, keys)` makes a DEALER a CURVE client of the router (before it connects).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

ENV = "PDSERVE_CONTROL_KEYS"
_SEP = ","  # not in the Z85 alphabet


@dataclass(frozen=True)
class ControlKeys:
    server_public: bytes  # the router's CURVE public key (Z85)
    client_public: bytes  # this worker incarnation's key pair (Z85)
    client_secret: bytes

    def __repr__(self) -> str:  # the secret never reaches a log line
        return f"ControlKeys(server={self.server_public.decode()}, client={self.client_public.decode()})"

    def to_env(self) -> str:
        return _SEP.join(k.decode("ascii") for k in (self.server_public, self.client_public, self.client_secret))

    @staticmethod
    def from_text(text: str) -> ControlKeys:
        parts = text.split(_SEP)
        if len(parts) != 3 or any(len(p) != 40 for p in parts):
            raise ValueError(f"{ENV}: expected three Z85 keys of 40 characters")
        return ControlKeys(*(p.encode("ascii") for p in parts))


def from_env() -> ControlKeys | None:
    """The keys the launcher put in this process's environment (removed from it), or None."""
    text = os.environ.pop(ENV, None)
    return None if text is None else ControlKeys.from_text(text)


def secure(sock: zmq.Socket, keys: ControlKeys | None) -> None:
    """Make `sock` a CURVE client of the router (no keys: a plain socket, which the router refuses)."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
