"""The benchmark client's transport: kernel-stamped TCP reads and the raw HTTP client's connection pool."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import pytest

from pdserve.bench.http import stampedsock
from pdserve.bench.http.rawhttp import RawHttpClient
from pdserve.bench.standin import StandinConfig, StandinProcess


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


async def _eventually(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _stamped(client: socket.socket, server: socket.socket) -> bool:
    """Send one probe byte; whether the kernel stamped it on arrival."""
    client.sendall(b"p")
    _, ancdata, _, _ = server.recvmsg(16, socket.CMSG_SPACE(16))
    return bool(ancdata)


def _pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return client, server


@pytest.mark.skipif(sys.platform != "linux", reason="SO_TIMESTAMPNS is Linux's")
def test_stamp_is_the_arrival_not_the_read():
    client, server = _pair()
    with client, server:
        assert stampedsock.enable_stamps(server)
        _wait_until(lambda: _stamped(client, server))  # the kernel turns stamping on from a work queue
        before_s = time.perf_counter()
        client.sendall(b"x" * 100)
        after_s = time.perf_counter()
        time.sleep(0.05)  # read 50 ms after arrival: a read-time stamp would be >= 50 ms late
        data, stamp_s = stampedsock.recv_stamped(server)
        assert data == b"x" * 100
        # above: 1 ms for the two clocks' rates; below: 20 ms, still far from any mistaken
        # conversion, for this process being preempted between recv_stamped's two clock reads
        assert before_s - 0.02 <= stamp_s <= after_s + 1e-3


def test_stream_writes_past_the_socket_buffer_and_reports_loss():
    async def scenario() -> None:
        client, server = _pair()
        received = bytearray()
        lost = []
        payload = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than the kernel buffers hold
        with server:
            stream = stampedsock.StampedStream(client, lambda _t, d: received.extend(d), lambda: lost.append(1))
            stream.write(payload)
            server.setblocking(False)
            reader = asyncio.get_running_loop()
            got = bytearray()
            while len(got) < len(payload):
                got += await reader.sock_recv(server, 1 << 20)
            await stream.drain()
            assert bytes(got) == payload
            server.sendall(b"reply")
            await _eventually(lambda: len(received) >= 5)
            assert bytes(received) == b"reply" and not lost
        await _eventually(lambda: lost)  # the peer closed
        assert lost == [1] and stream.closed
        stream.close()  # idempotent
        with pytest.raises(ConnectionError):
            stream.write(b"late")

    asyncio.run(scenario())


def test_raw_client_keeps_spare_connections_and_closes_them():
    async def scenario(url: str) -> None:
        client = RawHttpClient(url, spare=2)
        body = {"model": "standin", "prompt": "hi", "max_tokens": 3, "stream": True}
        for _ in range(3):
            async with client.post_lines("/v1/completions", body) as response:
                lines = [line async for _, line in response.lines if line.startswith("data:")]
            assert response.status == 200 and lines[-1] == "data: [DONE]"
        await _eventually(lambda: len(client._idle) >= 3)  # spares open in the background
        assert len(client._idle) == 3  # the one that served plus two spares
        assert all(not conn.closed for conn in client._idle)
        idle = list(client._idle)
        await client.aclose()
        assert not client._idle and all(conn.closed for conn in idle)

    with StandinProcess(StandinConfig()) as server:
        asyncio.run(scenario(server.url))


def test_raw_client_resends_once_when_an_idle_connection_was_closed_under_it():
    """A server that drops a kept-alive connection when its second request arrives (as a
    keep-alive timeout racing the send does): the client sends again on a new connection."""
    response = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 22\r\n\r\ndata: x\n\ndata: [DONE]\n"
    accepted = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if served:
                    break  # close without answering
                writer.write(response)
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RawHttpClient(f"http://127.0.0.1:{port}", spare=0)
        for _ in range(3):
            async with client.post_lines("/v1/completions", {"prompt": "x"}) as reply:
                lines = [line async for _, line in reply.lines if line]
            assert reply.status == 200 and lines == ["data: x", "data: [DONE]"]
        await client.aclose()
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())
    assert len(accepted) == 3  # the 2nd and 3rd requests each found their reused connection dropped
