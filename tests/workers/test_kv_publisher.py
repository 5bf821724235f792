"""The vLLM KV-events publisher's edges (workers/kv_publisher.py): `pdserve serve` refuses
endpoint flags whose per-worker port ranges collide before any worker starts, and the replay
socket answers every request, a malformed one with the end marker alone."""

from __future__ import annotations

import socket

import pytest
import zmq

import pdserve.api.server as server
from pdserve.api.server import ServeConfig
from pdserve.cli import main
from pdserve.engine.kv.vllm_events import VllmEventSink
from pdserve.workers.kv_publisher import END_OF_REPLAY, KvEventPublisher

PUB, REP = "--kv-events-endpoint", "--kv-events-replay-endpoint"


def test_overlapping_port_ranges_are_refused_at_the_flags(monkeypatch, capsys):
    """Two workers at 5640+i and replay at 5641+i share port 5641: one worker would die binding it
    and the start would wait out its registration timeout without naming why."""
    def started(config):
        raise AssertionError("the server started with overlapping KV-events ports")

    monkeypatch.setattr(server, "serve", started)
    argv = ["serve", "--model", "tiny", "--mode", "colocated", "--replicas", "2",
            PUB, "tcp://127.0.0.1:5640", REP, "tcp://127.0.0.1:5641"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and PUB in err[0] and REP in err[0], err
    assert "5640..5641" in err[0] and "5641..5642" in err[0]


@pytest.mark.parametrize("pub, rep, replicas", [
    ("tcp://127.0.0.1:5640", "tcp://127.0.0.1:5642", 2),  # adjacent ranges
    ("tcp://127.0.0.1:5643", "tcp://127.0.0.1:5640", 3),  # replay below
    ("tcp://127.0.0.1:5640", None, 4),
])
def test_disjoint_ranges_are_accepted(pub, rep, replicas):
    ServeConfig(mode="colocated", replicas=replicas, kv_events_endpoint=pub, kv_events_replay_endpoint=rep)


@pytest.mark.parametrize("pub, rep, replicas, said", [
    ("tcp://127.0.0.1:5643", "tcp://127.0.0.1:5640", 4, "overlap"),
    ("tcp://127.0.0.1:5640", "tcp://127.0.0.1:5640", 1, "overlap"),
    ("tcp://127.0.0.1:65535", None, 2, "outside 1..65535"),
    ("tcp://127.0.0.1", None, 1, "tcp://HOST:PORT"),
])
def test_colliding_or_impossible_ranges_are_refused(pub, rep, replicas, said):
    with pytest.raises(ValueError, match=said):
        ServeConfig(mode="colocated", replicas=replicas, kv_events_endpoint=pub, kv_events_replay_endpoint=rep)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def publisher():
    pub, rep = free_port(), free_port()
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
    publisher.publish(VllmEventSink(16))  # batch 0: the opening AllBlocksCleared
    yield publisher, f"tcp://127.0.0.1:{rep}"
    publisher.close()


def ask(endpoint: str, frames: tuple[bytes, ...], kind: int = zmq.DEALER) -> list[list[bytes]]:
    """Every reply to one request, up to the end marker (an empty list: none within 3 s)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(frames)
    replies = []
    try:
        while sock.poll(3000):
            replies.append(sock.recv_multipart())
            if replies[-1][-2] == END_OF_REPLAY:
                return replies
            if kind == zmq.REQ:  # a REQ socket takes one reply per request
                break
        return replies
    finally:
        sock.close(0)


@pytest.mark.parametrize("frames", [(b"abc",), (b"",), (b"", b"abc"), (b"", b""), (b"\0" * 9,),
                                    (b"\0" * 8, b"\0" * 8)],
                         ids=["3 bytes", "empty", "delimited 3 bytes", "delimited empty", "9 bytes", "two numbers"])
def test_a_malformed_replay_request_is_answered_with_the_end_marker(publisher, frames):
    """vLLM's replay sends nothing back to a request it cannot read, so its client waits forever;
    here the client gets the end marker (no batches) and the socket goes on serving."""
    _, endpoint = publisher
    replies = ask(endpoint, frames)
    assert replies == [[b"", END_OF_REPLAY, b""] if frames[0] == b"" and len(frames) > 1 else [END_OF_REPLAY, b""]]
    good = ask(endpoint, ((0).to_bytes(8, "big"),))
    assert [r[0] for r in good] == [(0).to_bytes(8, "big"), END_OF_REPLAY]


def test_a_req_client_asking_wrongly_gets_its_one_reply(publisher):
    _, endpoint = publisher
    assert ask(endpoint, (b"zz",), zmq.REQ) == [[END_OF_REPLAY, b""]]
