"""The control socket's failed-handshake count (router/process/control_handshakes.py): the tally
against a reference on generated connection histories, and the router's real socket and monitor
loop (router/process/frontend.py) against each kind of peer: one count per failed connection,
none for a worker's."""

from __future__ import annotations

import asyncio
import socket
import struct

import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.config import Mode, RouterConfig
from pdserve.router.process.control_handshakes import HandshakeTally
from pdserve.router.process.frontend import ClusterBackend
from pdserve.router.router import Router
from pdserve.workers import messages as m
from tests.router.router_fixtures import ABI, MODEL

A, D, OK = zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED
FAILED = {"protocol": zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "auth": zmq.EVENT_HANDSHAKE_FAILED_AUTH,
          "no_detail": zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def feed(tally: HandshakeTally, events, now: float = 0.0) -> list[int]:
    """Events as (event, value) at `now`, or (event, value, time)."""
    return [tally.on_event(e[0], e[1], e[2] if len(e) > 2 else now) for e in events]


def test_each_kind_of_connection_as_libzmq_reports_it():
    """The event sequences libzmq 4.3 emits (the contract's table), one connection at a time."""
    tally = HandshakeTally()
    assert feed(tally, [(A, 20), (OK, 0)]) == [0, 0]  # a worker, still connected
    assert sum(feed(tally, [(A, 21), (D, 21)])) == 1  # HTTP: no handshake event at all
    assert sum(feed(tally, [(A, 21), (FAILED["protocol"], 0x11000002), (D, 21)])) == 1  # a plain zmq client
    assert sum(feed(tally, [(A, 21), (FAILED["auth"], 400), (D, 21)])) == 1  # an unissued key
    assert sum(feed(tally, [(A, 21), (FAILED["no_detail"], 32), (D, 21)])) == 1  # left mid-handshake
    assert feed(tally, [(D, 20)]) == [0]  # the worker leaves: not a failure
    assert feed(tally, [(D, 99), (OK, 0), (FAILED["auth"], 0)]) == [0, 0, 0]  # never accepted: nothing to judge
    assert not tally.open


def test_a_rogue_beside_workers_counts_whatever_the_order():
    """The successes carry no descriptor: a rogue's close is a failure while the workers' connections
    can hold every success; a worker connection past the handshake interval is a worker's."""
    tally = HandshakeTally(handshake_s=30.0)
    assert feed(tally, [(A, 21, 0.0), (A, 23, 0.1), (OK, 0, 0.2), (D, 21, 1.0), (D, 23, 2.0)]) == [0, 0, 0, 1, 0]
    tally = HandshakeTally(handshake_s=30.0)  # the worker connected first and leaves first, after the interval
    assert feed(tally, [(A, 23, 0.0), (OK, 0, 0.1), (A, 21, 40.0), (D, 23, 41.0), (D, 21, 42.0)]) == [0, 0, 0, 0, 1]


HANDSHAKE_S = 30.0
KINDS = ("worker", "protocol", "auth", "no_detail", "silent")


@st.composite
def connections(draw) -> list[tuple[str, float, float, float]]:
    """(kind, accepted, outcome, closed) times as libzmq allows them: every outcome within the
    handshake interval of the accept (a rogue closes by then); a worker lives past the interval."""
    out = []
    for kind in draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=8)):
        accepted = draw(st.floats(0, 100))
        outcome = accepted + draw(st.floats(0.001, HANDSHAKE_S - 1))
        closed = outcome + (draw(st.floats(HANDSHAKE_S, 200)) if kind == "worker" else draw(st.floats(0, 0.5)))
        out.append((kind, accepted, outcome, closed))
    return out


def history(conns) -> list[tuple[float, int, int, int]]:
    """The monitor's events, in time order: (time, event, descriptor or code, 1 when the event is the
    close of a failed connection); descriptors reused lowest-first, as the kernel does."""
    steps = []
    for i, (kind, accepted, outcome, closed) in enumerate(conns):
        steps.append((accepted, i, "accept"))
        if kind == "worker":
            steps += [(outcome, i, "ok"), (closed, i, "close")]
        elif kind == "silent":
            steps.append((closed, i, "close"))
        else:
            steps.append((outcome, i, "fail+close"))
    fds, free, events = {}, list(range(10, 10 + len(conns))), []
    for t, i, step in sorted(steps):
        kind = conns[i][0]
        if step == "accept":
            fds[i] = free.pop(0)
            events.append((t, A, fds[i], 0))
        elif step == "ok":
            events.append((t, OK, 0, 0))
        elif step == "fail+close":
            events += [(t, FAILED[kind], 1, 0), (t, D, fds[i], 1)]
        else:
            events.append((t, D, fds[i], int(kind == "silent")))
        if step in ("close", "fail+close"):
            free = sorted([*free, fds[i]])
    return events


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(connections())
def test_every_failed_connection_counts_once_at_its_close_and_no_worker_counts(conns):
    """Reference: each close of a connection that did not complete the handshake, in any
    interleaving of rogues and workers (libzmq's timing rules, `connections`)."""
    events = history(conns)
    counts = feed(HandshakeTally(HANDSHAKE_S), [(e, v, t) for t, e, v, _ in events])
    assert counts == [failed for *_, failed in events]


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from(KINDS), min_size=1, max_size=8), st.floats(0.001, 0.5))
def test_connections_one_after_another_are_judged_exactly_however_short_a_worker_s(kinds, life_s):
    conns = [(kind, 10.0 * i, 10.0 * i + 0.001, 10.0 * i + 0.001 + life_s) for i, kind in enumerate(kinds)]
    events = history(conns)
    counts = feed(HandshakeTally(HANDSHAKE_S), [(e, v, t) for t, e, v, _ in events])
    assert counts == [failed for *_, failed in events]


# ---- the router's real socket ---------------------------------------------------------------
def register(worker_id: str) -> bytes:
    return m.encode(m.Register(worker_id, 1, "h0", "decode", 1, 100, 16, MODEL, ABI, 64, 4096))


def rejects(backend: ClusterBackend) -> dict[str, float]:
    return {reason: backend.metrics.control_rejects.labels(reason)._value.get() for reason in ("handshake", "unknown_key")}


async def settle(backend: ClusterBackend, before: dict, want: dict, wait_s: float = 10.0, quiet_s: float = 0.5) -> dict:
    """The growth of the reject counts once `want` is reached (or `wait_s` passed), after a further
    `quiet_s` in which nothing more may arrive (monitor events come asynchronously)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline and any(rejects(backend)[r] - before[r] < n for r, n in want.items()):
        await asyncio.sleep(0.02)
    await asyncio.sleep(quiet_s)
    return {r: rejects(backend)[r] - before[r] for r in before}


def send_raw(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
        peer.sendall(data)
        try:
            peer.recv(64)  # until the router closes it (or answers its greeting)
        except OSError:
            pass


def huge_frame(port: int) -> None:
    """ZMTP 3.0 with CURVE, then a command frame past ZMQ_MAXMSGSIZE instead of the HELLO."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
        peer.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\x00") + bytes(32))
        peer.recv(64)
        try:
            peer.sendall(b"\x06" + struct.pack(">Q", 1 << 40))
            peer.recv(64)
        except OSError:
            pass


def dealer(ctx: zmq.asyncio.Context, address: str, identity: bytes, keys=None) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection: the count is then exactly one per peer
    if keys is not None:  # (server public, client public, client secret)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(address)
    return sock


def test_each_rogue_connection_counts_once_and_a_worker_s_none():
    """HTTP-like bytes and an oversized pre-handshake frame used to count nothing (libzmq sends no
    handshake event for them); a plain zmq client, an unissued key and bytes starting with 0xff
    count one each; a worker's three sockets (main, #hb, #fetch), registering and then leaving,
    count nothing."""

    async def scenario():
        backend = ClusterBackend(Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="jsq")), "test", None, 4096,
                                 "tcp://127.0.0.1:*")
        backend.start()
        ctx = zmq.asyncio.Context()
        port = int(backend.address.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        grown = {}
        try:
            keys = backend.control_auth.issue("decode-0", 1)
            worker = [dealer(ctx, backend.address, ident, (keys.server_public, keys.client_public, keys.client_secret))
                      for ident in (b"decode-0", b"decode-0#hb", b"decode-0#fetch")]
            await worker[0].send(register("decode-0"))
            before = rejects(backend)
            grown["worker"] = await settle(backend, before, {}, quiet_s=1.0)
            assert "decode-0" in backend.registered  # (retired later: it sends no heartbeats)
            for name, peer in (("http", lambda: send_raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")),
                               ("0xff bytes", lambda: send_raw(port, b"\xff" * 16 + bytes(range(256)))),
                               ("huge frame", lambda: huge_frame(port))):
                before = rejects(backend)
                await loop.run_in_executor(None, peer)
                grown[name] = await settle(backend, before, {"handshake": 1})
            unissued = zmq.curve_keypair()
            for name, sock_keys in (("plain zmq", None), ("unissued key", (keys.server_public, *unissued))):
                before = rejects(backend)
                rogue = dealer(ctx, backend.address, b"rogue-0", sock_keys)
                grown[name] = await settle(backend, before, {"handshake": 1})
                rogue.close()
            before = rejects(backend)
            for sock in worker:
                sock.close()
            grown["worker leaves"] = await settle(backend, before, {}, quiet_s=1.0)
        finally:
            ctx.destroy(linger=0)
            await backend.close()
        return grown

    grown = asyncio.run(scenario())
    assert grown == {"worker": {"handshake": 0, "unknown_key": 0}, "http": {"handshake": 1, "unknown_key": 0},
                     "0xff bytes": {"handshake": 1, "unknown_key": 0}, "huge frame": {"handshake": 1, "unknown_key": 0},
                     "plain zmq": {"handshake": 1, "unknown_key": 0}, "unissued key": {"handshake": 1, "unknown_key": 1},
                     "worker leaves": {"handshake": 0, "unknown_key": 0}}
