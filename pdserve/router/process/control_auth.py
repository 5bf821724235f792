"""Who may speak on the router's control socket: CURVE keys the router issued, bound to a worker.

Contract: `ControlAuth` owns the router's CURVE server key pair and issues one client key pair
per worker incarnation (`issue(worker_id, epoch)`, called by the launcher at every start and
restart; the worker's previous key is revoked). `secure(sock)` makes the ROUTER socket a CURVE
server whose ZAP domain is this router's own and whose frames are bounded (`MAX_TO_ROUTER_BYTES`:
libzmq buffers a frame whole before the CURVE handshake even looks at it): the process's ZAP handler (pyzmq's
ThreadAuthenticator, one per process, started on first use) admits a connection only with a key
this router issued and has not revoked; with ZAP_ENFORCE_DOMAIN, nothing is admitted before the
handler runs. `accept(frames)` checks one received message and returns it, or the reason it is
dropped:
    frames      not exactly [routing id, body]
    unknown_key the connection's key is not (or no longer) issued
    decode      the body is not a worker -> router message
    identity    the message names another worker than its key's, or its routing id does (a
                worker speaks from its main socket, its heartbeat socket `#hb` and its fetch
                socket `#fetch`: workers/prefix_fetch/fetch_control.py)
    epoch       a Register under another epoch than the key's (a role change advances it: `advance`)
Before any message: every connection that fails its handshake (no CURVE, not ZMTP, a refused
key) counts once as `handshake` when it closes (control_handshakes.py, from the socket monitor),
and each key the ZAP handler refuses also as `unknown_key` (`on_refused`). Every reject is counted by reason
(`pdserve_control_rejects_total`, router/process/metrics.py); none ends a loop.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pdserve.workers import messages as m
from pdserve.workers.control_keys import ControlKeys
from pdserve.workers.prefix_fetch.fetch_control import FETCH_SUFFIX

HEARTBEAT_SUFFIX = "#hb"  # a worker's heartbeat socket's routing id (workers/heartbeat.py)


@dataclass
class _Binding:
    worker_id: str
    epoch: int


class ControlAuth:
    def __init__(self, on_refused: Callable[[str], None] = lambda reason: None):
        self.on_refused = on_refused  # counts a key the ZAP handler refused (from its thread)
        self.server_public, self._server_secret = zmq.curve_keypair()
        self.domain = f"pdserve-{secrets.token_hex(8)}"
        self._bindings: dict[bytes, _Binding] = {}  # issued client public key (Z85) -> its worker
        self._keys: dict[str, bytes] = {}  # worker id -> its current key
        self._lock = threading.Lock()  # the ZAP thread reads what the router's loop writes

    # ---- key authority --------------------------------------------------------------------
    def issue(self, worker_id: str, epoch: int) -> ControlKeys:
        """A fresh key pair for `worker_id`'s incarnation under `epoch`; its previous key is revoked."""
        public, secret = zmq.curve_keypair()
        with self._lock:
            self._bindings.pop(self._keys.get(worker_id, b""), None)
            self._keys[worker_id] = public
            self._bindings[public] = _Binding(worker_id, epoch)
        return ControlKeys(self.server_public, public, secret)

    def revoke(self, worker_id: str) -> None:
        """`worker_id`'s key admits nothing from now on (new connections and messages alike)."""
        with self._lock:
            self._bindings.pop(self._keys.pop(worker_id, b""), None)

    def advance(self, worker_id: str, epoch: int) -> None:
        """The router moved a live worker to `epoch` (ChangeRole): its key may register under it."""
        with self._lock:
            binding = self._bindings.get(self._keys.get(worker_id, b""))
            if binding is not None and epoch > binding.epoch:
                binding.epoch = epoch

    def is_issued(self, public_z85: bytes) -> bool:
        with self._lock:
            return public_z85 in self._bindings

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question (its thread): may this CURVE client key connect?"""
        allowed = domain == self.domain and self.is_issued(key)
        if not allowed:
            self.on_refused("unknown_key")
        return allowed

    # ---- the socket -----------------------------------------------------------------------
    def secure(self, sock: zmq.Socket) -> None:
        """Before bind: CURVE server under this router's ZAP domain, nothing admitted without ZAP."""
        sock.curve_server = True
        sock.curve_secretkey = self._server_secret
        sock.curve_publickey = self.server_public
        sock.zap_domain = self.domain.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.maxmsgsize = m.MAX_TO_ROUTER_BYTES  # a longer frame ends its connection (handshake or not)

    def start(self, context: zmq.Context) -> None:
        _handler(context).configure_curve_callback(self.domain, self)

    def stop(self) -> None:
        if _ZAP is not None:
            _ZAP.credentials_providers.pop(self.domain, None)

    # ---- one received message -------------------------------------------------------------
    def accept(self, frames: list) -> tuple[object | None, str]:
        """(message, "") for a message from an issued key that names its key's worker, else (None, reason)."""
        if len(frames) != 2:
            return None, "frames"
        ident, body = frames
        with self._lock:
            binding = self._bindings.get(_user_id(body))
            binding = None if binding is None else _Binding(binding.worker_id, binding.epoch)
        if binding is None:
            return None, "unknown_key"
        try:
            msg = m.decode_to_router(body.bytes)
        except Exception:  # noqa: BLE001 - msgspec raises several kinds; any of them is a bad message
            return None, "decode"
        wid = binding.worker_id
        if msg.worker_id != wid or ident.bytes.decode(errors="replace") not in (wid, wid + HEARTBEAT_SUFFIX, wid + FETCH_SUFFIX):
            return None, "identity"
        if isinstance(msg, m.Register) and msg.epoch != binding.epoch:
            return None, "epoch"
        return msg, ""


def _user_id(frame) -> bytes:
    try:
        return frame.get("User-Id").encode()  # ZAP's user id: the client key in Z85 (pyzmq's default)
    except (zmq.ZMQError, AttributeError):
        return b""


_ZAP: ThreadAuthenticator | None = None
_ZAP_LOCK = threading.Lock()


def _handler(context: zmq.Context) -> ThreadAuthenticator:
    """The process's one ZAP handler (one per zmq context; every router in it has its own domain)."""
    global _ZAP
    with _ZAP_LOCK:
        if _ZAP is None or _ZAP.context is not context or not _ZAP.is_alive():
            _ZAP = ThreadAuthenticator(context)
            _ZAP.start()
        return _ZAP
