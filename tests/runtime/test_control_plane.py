"""Fault tests of the served edges (issue 35, parts 2 and 6): forged and garbage messages on the
router's control socket, and unauthenticated or oversized HTTP calls. Each drives the real trigger
against a served 1P1D cluster (real worker processes, the router's real zmq socket, the app behind
a real uvicorn server) and then checks the server still serves: a completion succeeds, /health is
ok, /workers names only the launched workers, and the rejects were counted."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import httpx
import pytest
import uvicorn
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.app import create_app
from pdserve.workers import messages as m
from tests.runtime.conftest import config, prompt, wait_baseline
from tests.runtime.shared_cluster import SharedCluster

ADMIN = "s3cret-admin"
KEY = "k-tenant-a"
LAUNCHED = {"prefill-0", "decode-0"}
LIMIT = 64 << 10  # the second app's --max-request-body-bytes


@pytest.fixture(scope="module")
def served():
    """One 1P1D cluster with two apps on it: the defaults plus an admin token, and API keys with a
    small body limit. Rogue peers connect and leave; nothing here kills or changes a worker."""
    cluster = SharedCluster(config())
    try:
        cluster.ports = cluster.run(_serve_apps(cluster))
        yield cluster
    finally:
        cluster.run(_stop_apps(cluster))
        cluster.close()


async def _serve_apps(cluster) -> tuple[int, int]:
    apps = [create_app(cluster.backend, admin_token=ADMIN),
            create_app(cluster.backend, api_keys={KEY: "tenant-a"}, **_limit())]
    cluster.servers = []
    for app in apps:
        # bound here, not a port picked and bound later by uvicorn: another process may take a
        # picked port first, and uvicorn then exits (SystemExit) and stops the cluster's loop
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, port=sock.getsockname()[1], log_level="warning"))
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        cluster.servers.append((server, task))
        while not server.started:
            if task.done():
                raise RuntimeError(f"the app did not start: {task.exception()!r}")
            await asyncio.sleep(0.02)
    return tuple(s.config.port for s, _ in cluster.servers)


def _limit() -> dict:
    return {"max_request_body_bytes": LIMIT}


async def _stop_apps(cluster) -> None:
    for server, task in getattr(cluster, "servers", []):
        server.should_exit = True
        await task


def rejects(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "pdserve_control_rejects" for s in f.samples if s.name.endswith("_total")}


def wait_rejects(port: int, before: dict, want: dict[str, int], timeout_s: float = 15.0) -> dict[str, float]:
    """The reject counts once every reason in `want` grew by at least its number (the socket
    monitor reports handshakes asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = rejects(port)
        grown = {r: now.get(r, 0) - before.get(r, 0) for r in want}
        if all(grown[r] >= n for r, n in want.items()) or time.monotonic() > deadline:
            return grown
        time.sleep(0.05)


def completes(port: int, headers: dict | None = None) -> dict:
    """A real completion through the served app, after the fault: it must answer, in bounded time."""
    body = {"model": "tiny", "prompt": list(prompt(40, 7)), "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 6
    return answer.json()


def assert_still_serving(cluster, port: int, headers: dict | None = None) -> None:
    completes(port, headers)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()
    assert {w["id"] for w in workers} == LAUNCHED
    cluster.run(wait_baseline(cluster.backend))


def forged_register(worker_id: str, epoch: int = 1, role: str = "decode") -> bytes:
    return m.encode(m.Register(worker_id, epoch, "evil-host", role, 1, 4096, 16, "model", "abi", 64, 4096,
                               handoff_address=("127.0.0.1", 9)))


def dealer(ctx: zmq.Context, address: str, identity: bytes, keys=None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)  # a peer the router refused may have no pipe to send on: never block
    if keys is not None:  # (server public, client public, client secret)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(address)
    return sock


def try_send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send what a rogue would; its handshake failed, so libzmq may hold no pipe for it (DEALER's
    send then waits for one that never comes): a refused send is the router's refusal too."""
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        pass


def test_unauthenticated_peers_on_the_router_socket_never_register_and_the_server_keeps_serving(served):
    """A peer on the router's address without the router's keys: raw bytes that are not ZMTP, and
    a zmq client that forges a Register and then sends garbage multipart frames. Before CURVE the
    Register made the rogue a decode worker, and the 3-frame message ended the receive loop."""
    port = served.ports[0]
    address = served.backend.address
    before = rejects(port)
    with socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1]))) as raw:
        raw.sendall(b"\xff" * 16 + b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
    ctx = zmq.Context()
    try:
        rogue = dealer(ctx, address, b"rogue-0")
        try_send(rogue, [forged_register("rogue-0")])
        time.sleep(0.5)
        try_send(rogue, [b"one", b"two"])  # three frames at the router
        try_send(rogue, [b"\x93not msgpack"])
        grown = wait_rejects(port, before, {"handshake": 2})
    finally:
        ctx.destroy(linger=0)
    assert_still_serving(served, port)
    assert grown["handshake"] >= 2  # the raw bytes, and every attempt of the zmq client


def _stream_frame(port: int, declared: int, chunk: bytes) -> int:
    """A peer that speaks ZMTP 3.0 with the CURVE mechanism (as anyone may) and, instead of its
    HELLO, streams a command frame declaring `declared` bytes; how many the router took before it
    closed the connection."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as peer:
        peer.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\x00") + bytes(32))
        peer.recv(64)  # the router's greeting
        try:
            peer.sendall(b"\x06" + struct.pack(">Q", declared))  # command frame, 8-byte length
            while sent < declared:
                peer.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset or broken pipe: the router cut it off
            pass
    return sent


def test_a_peer_streaming_a_huge_frame_before_its_handshake_is_cut_off_at_the_bound(served):
    """libzmq reads a frame whole before the CURVE handshake looks at it: without a bound, a peer
    with no key could make the router buffer any size it declares (1 GiB grew it by 1 GiB)."""
    port = served.ports[0]
    sent = _stream_frame(int(served.backend.address.rsplit(":", 1)[1]), 1 << 30, bytes(1 << 20))  # a keyless 1 GiB frame
    assert sent < 128 << 20, f"the router took {sent >> 20} MiB of one unauthenticated frame"  # bound: 64 MiB
    assert_still_serving(served, port)


def test_wrong_and_revoked_keys_are_refused_and_a_key_holder_cannot_break_the_loop(served):
    """CURVE clients: one with a key the router never issued, one with a key it revoked (a later
    incarnation of the same worker got a new one), and one holding a key issued for worker
    `ghost-0` (epoch 2) that sends every kind of bad message."""
    port = served.ports[0]
    auth = served.backend.control_auth
    address = served.backend.address
    before = rejects(port)
    stale = auth.issue("ghost-0", 1)
    held = auth.issue("ghost-0", 2)  # revokes `stale`
    unissued = zmq.curve_keypair()
    ctx = zmq.Context()
    try:
        refused = [dealer(ctx, address, ident, keys) for ident, keys in
                   ((b"rogue-1", (auth.server_public, *unissued)),
                    (b"ghost-1", (auth.server_public, stale.client_public, stale.client_secret)))]
        for sock in refused:
            try_send(sock, [forged_register(sock.getsockopt(zmq.IDENTITY).decode())])
        ghost = dealer(ctx, address, b"ghost-0", (held.server_public, held.client_public, held.client_secret))
        ghost.send_multipart([b"one", b"two"])  # frames
        ghost.send(b"\x93not msgpack")  # decode
        ghost.send(forged_register("decode-0", 1))  # identity: another worker's id
        ghost.send(forged_register("ghost-0", 3))  # epoch: not the key's
        ghost.send(forged_register("ghost-0", 2, role="bogus"))  # invalid: its handler cannot apply it
        grown = wait_rejects(port, before, {"unknown_key": 2, "frames": 1, "decode": 1, "identity": 1, "epoch": 1,
                                            "invalid": 1})
    finally:
        ctx.destroy(linger=0)
        auth.revoke("ghost-0")
    assert grown == {"unknown_key": grown["unknown_key"], "frames": 1, "decode": 1, "identity": 1, "epoch": 1, "invalid": 1}
    assert grown["unknown_key"] >= 2
    assert_still_serving(served, port)


def test_unauthenticated_calls_answer_401_before_the_body_is_read(served):
    """An admin call and a keyed completion without credentials, each with a body that is not
    JSON: the credential is checked first (401), not the body (400/422)."""
    admin_port, keyed_port = served.ports
    bad = b'{"enabled": tru'
    for port, path in ((admin_port, "/admin/disaggregation"), (admin_port, "/admin/rollback"),
                       (keyed_port, "/v1/completions"), (keyed_port, "/v1/chat/completions")):
        answer = httpx.post(f"http://127.0.0.1:{port}{path}", content=bad, timeout=10,
                            headers={"Content-Type": "application/json"})
        assert answer.status_code == 401, (path, answer.status_code, answer.text)
        assert answer.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(f"http://127.0.0.1:{admin_port}/admin/disaggregation", content=bad, timeout=10,
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    state = httpx.get(f"http://127.0.0.1:{admin_port}/admin/state", timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert state["state"] == "ACTIVE" and state["disaggregation"] is True
    assert_still_serving(served, keyed_port, {"Authorization": f"Bearer {KEY}"})


def raw_post(port: int, path: str, head: dict[str, str], chunks: list[bytes], chunked: bool) -> int:
    """POST over a plain socket, sending as much of the body as the server takes; the status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        lines = [f"POST {path} HTTP/1.1", "Host: pdserve", "Content-Type: application/json",
                 *(f"{k}: {v}" for k, v in head.items())]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for chunk in chunks:
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        except OSError:
            pass  # the server answered and closed before the whole body went out: that is the point
        reply = b""
        while b"\r\n" not in reply:
            data = conn.recv(4096)
            if not data:
                break
            reply += data
    return int(reply.split(b" ", 2)[1])


def test_an_oversized_body_answers_413_while_it_streams_in_and_the_server_keeps_serving(served):
    """The default limit (4 MiB) against an 8 MiB declared body, sent or not; the small limit
    (64 KiB) against a chunked body that never declares its size."""
    admin_port, keyed_port = served.ports
    auth = {"Authorization": f"Bearer {KEY}"}
    declared = raw_post(admin_port, "/v1/completions", {"Content-Length": str(8 << 20)}, [], chunked=False)
    sent = raw_post(admin_port, "/v1/completions", {"Content-Length": str(8 << 20)}, [b" " * (1 << 20)] * 8, chunked=False)
    streamed = raw_post(keyed_port, "/v1/completions", {**auth, "Transfer-Encoding": "chunked"}, [b" " * (16 << 10)] * 64,
                        chunked=True)
    assert (declared, sent, streamed) == (413, 413, 413)
    assert_still_serving(served, admin_port)
    assert_still_serving(served, keyed_port, auth)

