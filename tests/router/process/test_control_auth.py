"""The router's control-socket authority (router/process/control_auth.py) and what happens when a router
task dies anyway (router/process/frontend.py): pure checks of every reject reason with stand-in frames,
and a backend whose receive loop loses its socket."""

from __future__ import annotations

import asyncio

import zmq

from pdserve.router.config import Mode, RouterConfig
from pdserve.router.process.control_auth import ControlAuth
from pdserve.router.process.frontend import ClusterBackend
from pdserve.router.router import Router
from pdserve.workers import messages as m
from pdserve.workers.control_keys import ControlKeys
from tests.router.router_fixtures import ABI, MODEL


class Frame:
    """A received zmq frame as ControlAuth reads it: its bytes and the ZAP user id (the Z85 key)."""

    def __init__(self, data: bytes, user_id: bytes | None):
        self.bytes, self._user = data, user_id

    def get(self, prop: str) -> str:
        if self._user is None:
            raise zmq.ZMQError(zmq.EINVAL)
        return self._user.decode()


def register(worker_id: str, epoch: int, role: str = "decode") -> bytes:
    return m.encode(m.Register(worker_id, epoch, "h0", role, 1, 100, 16, MODEL, ABI, 64, 4096))


def heartbeat(worker_id: str, epoch: int) -> bytes:
    return m.encode(m.Heartbeat(worker_id, epoch, m.Load(0, 0, 0, 100, 0)))


def accept(auth: ControlAuth, keys: ControlKeys | None, ident: bytes, body: bytes):
    return auth.accept([Frame(ident, None), Frame(body, None if keys is None else keys.client_public)])


def test_every_reject_reason_and_the_messages_that_pass():
    auth = ControlAuth()
    keys = auth.issue("decode-0", 1)
    msg, reason = accept(auth, keys, b"decode-0", register("decode-0", 1))
    assert isinstance(msg, m.Register) and reason == ""
    assert accept(auth, keys, b"decode-0#hb", heartbeat("decode-0", 1))[1] == ""  # the heartbeat socket
    assert auth.accept([Frame(b"decode-0", None)])[1] == "frames"
    assert auth.accept([Frame(b"decode-0", None), Frame(b"a", keys.client_public), Frame(b"b", None)])[1] == "frames"
    assert accept(auth, None, b"decode-0", register("decode-0", 1))[1] == "unknown_key"
    assert accept(auth, keys, b"decode-0", b"\x93garbage")[1] == "decode"
    assert accept(auth, keys, b"decode-0", b"\x81\xa4type\xa8Shutdown")[1] == "decode"  # a router -> worker message
    assert accept(auth, keys, b"decode-0", register("prefill-0", 1))[1] == "identity"  # another worker's id
    assert accept(auth, keys, b"prefill-0", heartbeat("decode-0", 1))[1] == "identity"  # another routing id
    assert accept(auth, keys, b"decode-0", register("decode-0", 2))[1] == "epoch"


def test_a_new_incarnation_revokes_the_old_key_and_a_role_change_advances_the_epoch():
    refused: list[str] = []
    auth = ControlAuth(refused.append)
    old = auth.issue("decode-0", 1)
    new = auth.issue("decode-0", 2)
    assert accept(auth, old, b"decode-0", register("decode-0", 1))[1] == "unknown_key"
    assert not auth.callback(auth.domain, old.client_public) and auth.callback(auth.domain, new.client_public)
    assert not auth.callback("another-router", new.client_public)  # a key is this router's only
    assert refused == ["unknown_key", "unknown_key"]
    auth.advance("decode-0", 3)  # ChangeRole(role, 3) went out (router/process/role_control.py)
    assert accept(auth, new, b"decode-0", register("decode-0", 2))[1] == "epoch"
    assert accept(auth, new, b"decode-0", register("decode-0", 3))[1] == ""
    auth.revoke("decode-0")
    assert accept(auth, new, b"decode-0", heartbeat("decode-0", 3))[1] == "unknown_key"
    assert "secret" not in repr(new) and new.client_secret.decode() not in repr(new)
    assert ControlKeys.from_text(new.to_text()) == new


def test_a_router_task_that_dies_marks_the_backend_unhealthy():
    """The receive loop loses its socket under it: /health must stop saying ok (it used to)."""

    async def scenario():
        backend = ClusterBackend(Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="jsq")), "test", None, 4096,
                                 "tcp://127.0.0.1:*")
        backend.start()
        for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            backend._on_register(m.decode_to_router(register(wid, 1, role)))
        assert backend.healthy()
        backend.sock.close()
        receive = backend._tasks[0]
        await asyncio.wait([receive], timeout=5)
        await asyncio.sleep(0)  # done callbacks run on the next pass of the loop
        try:
            assert not backend.healthy()
            assert backend.failed.startswith("receive: ")
            assert backend.metrics.loop_failures.labels("receive")._value.get() == 1
        finally:
            await backend.close()

    asyncio.run(scenario())
