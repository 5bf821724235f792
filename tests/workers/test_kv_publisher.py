"""The vLLM KV-events publisher's edges (workers/kv_publisher.py, its sockets in the relay process
of workers/kv_relay.py): `pdserve serve` refuses
endpoint flags whose per-worker port ranges collide before any worker starts, the replay socket
answers every request (a malformed one with the end marker alone), and a subscriber that joins,
or rejoins a restarted worker, gets a snapshot that clears what it held."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

import pdserve.api.server as server
from pdserve.api.server import ServeConfig
from pdserve.cli import main
from pdserve.engine.kv.vllm_events import AllBlocksCleared, BlockStored, KVEventBatch, VllmEventSink
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
    kept_through(f"tcp://127.0.0.1:{rep}", 0)
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


def kept_through(endpoint: str, seq: int, wait_s: float = 10.0) -> list[list[bytes]]:
    """The replay from 0 once it reaches `seq`: the relay process (workers/kv_relay.py) keeps a
    batch a moment after `publish` returns."""
    deadline = time.monotonic() + wait_s
    while True:
        kept = ask(endpoint, ((0).to_bytes(8, "big"),))
        if len(kept) > 1 and int.from_bytes(kept[-2][0], "big") >= seq or time.monotonic() > deadline:
            return kept
        time.sleep(0.05)


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


def apply(media: dict[bytes, set[str]], batch: KVEventBatch) -> None:
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            media.clear()
        elif isinstance(e, BlockStored):
            media.setdefault(e.block_hashes[0], set()).add(e.medium)
        else:
            media.get(e.block_hashes[0], set()).discard(e.medium)
            if not media.get(e.block_hashes[0], True):
                del media[e.block_hashes[0]]


def follow(sub: zmq.Socket, publisher: KvEventPublisher, sink: VllmEventSink, media: dict, wait_s: float) -> list[int]:
    """Publish as the worker's loop does (every ~2 ms) while applying what `sub` receives."""
    seqs, decode = [], msgspec.msgpack.Decoder(KVEventBatch)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        publisher.publish(sink)
        while sub.poll(2):
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            apply(media, decode.decode(payload))
    return seqs


def rebind(endpoint: str) -> KvEventPublisher:
    """The restarted worker's publisher (a closed socket releases its port asynchronously)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return KvEventPublisher(endpoint)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_a_subscriber_learns_of_a_restart_it_joined_too_late_to_see():
    """A worker restart: the new process binds the same port and publishes its opening
    AllBlocksCleared (sequence 0) before the subscriber has reconnected, so PUB/SUB drops it for
    that subscriber. The subscription is answered with a snapshot (AllBlocksCleared, then every
    block held), so the subscriber drops the old process's blocks and holds the new one's."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    old, old_sink = KvEventPublisher(endpoint), VllmEventSink(16)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 500)  # it comes back well after the new process's first batch
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.5)  # subscribed before the old process's first batch: it sees the whole history
    media: dict[bytes, set[str]] = {}
    old_sink.stored(b"old-1", None, tuple(range(16)))
    old_sink.stored(b"old-2", b"old-1", tuple(range(16, 32)))
    old_sink.demoted(b"old-1")
    follow(sub, old, old_sink, media, 1.0)
    assert media == {b"old-1": {"CPU"}, b"old-2": {"GPU"}}
    old.close()  # the worker dies
    new, new_sink = rebind(endpoint), VllmEventSink(16)
    try:
        new.publish(new_sink)  # sequence 0, AllBlocksCleared: no subscriber connected yet
        new_sink.stored(b"new-1", None, tuple(range(16)))
        seqs = follow(sub, new, new_sink, media, 2.0)
    finally:
        new.close()
        sub.close(0)
    assert media == {b"new-1": {"GPU"}}
    assert 0 not in seqs  # the new process's opening clear was lost to this subscriber


def test_the_replay_buffer_is_bounded_in_bytes_and_stays_gapless():
    """The kept batches are capped in bytes as well as in number (a snapshot of a large pool is
    hundreds of KB): the oldest go first, and what is kept is still numbered without gaps up to
    the newest."""
    pub, rep = free_port(), free_port()
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", buffer_bytes=20_000)
    sink = VllmEventSink(16)
    try:
        for i in range(200):  # ~1 KB a batch
            for j in range(8):
                sink.stored(b"h%05d-%d" % (i, j), None, tuple(range(16)))
            publisher.publish(sink)
        newest = 199 - publisher.num_dropped  # a batch the relay's channel could not take has no number
        kept = kept_through(f"tcp://127.0.0.1:{rep}", newest)
    finally:
        publisher.close()
    assert kept[-1] == [END_OF_REPLAY, b""]
    seqs = [int.from_bytes(r[0], "big") for r in kept[:-1]]
    assert seqs == list(range(seqs[0], newest + 1)) and seqs[0] > 0  # the newest kept, the oldest dropped
    assert sum(len(r[1]) for r in kept[:-1]) <= 20_000
