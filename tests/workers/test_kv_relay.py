"""The KV-events relay process (workers/kv_relay.py) and the worker's side of it
(workers/kv_publisher.py): the external sockets live in a process of their own, capped in memory
and niced; a batch the relay cannot take is dropped and the next one is a snapshot; a relay that
dies is replaced and its replacement starts with a snapshot; the relay never outlives its worker;
a relay that cannot bind fails the publisher's start with the endpoint named."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from pdserve.engine.kv.vllm_events import AllBlocksCleared, KVEventBatch, VllmEventSink
from pdserve.workers import kv_relay
from pdserve.workers.kv_publisher import KvEventPublisher
from tests.workers.test_kv_publisher import apply, ask, free_port
from tests.helpers.processes import exited as gone

DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def replayed(endpoint: str, until, wait_s: float = 15.0) -> list[tuple[int, KVEventBatch]]:
    """The replay from 0 once `until(batches)` holds (the relay keeps a batch a moment after `publish`)."""
    deadline = time.monotonic() + wait_s
    while True:
        kept = [(int.from_bytes(r[0], "big"), DECODE.decode(r[1])) for r in ask(endpoint, ((0).to_bytes(8, "big"),))[:-1]]
        if until(kept) or time.monotonic() > deadline:
            return kept
        time.sleep(0.05)


def wait_until(check, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def churn(sink: VllmEventSink, i: int, blocks: int = 100) -> None:
    """~10 KB of events that leave the held set as it was (stored, then removed)."""
    for j in range(blocks):
        h = b"churn-%06d-%03d" % (i, j)
        sink.stored(h, None, tuple(range(1000, 1016)))
        sink.removed(h)


def test_the_relay_is_a_niced_process_with_a_capped_data_segment():
    pub, rep = endpoints()
    publisher = KvEventPublisher(pub, rep)
    try:
        pid = publisher.relay_pid
        assert pid != os.getpid()
        with open(f"/proc/{pid}/stat") as f:
            nice = int(f.read().rsplit(")", 1)[1].split()[16])
        assert nice >= os.nice(0) + kv_relay.NICE
        limits = open(f"/proc/{pid}/limits").read()
        data = next(line for line in limits.splitlines() if line.startswith("Max data size")).split()[3]
        assert data != "unlimited" and int(data) < (64 << 20) + kv_relay.SLACK_BYTES + (512 << 20), data
        core = next(line for line in limits.splitlines() if line.startswith("Max core file size")).split()[4]
        assert core == "0"
    finally:
        publisher.close()
    assert wait_until(lambda: gone(pid)), "close() left the relay running"


def subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 50)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def follow_until(publisher: KvEventPublisher, sink: VllmEventSink, sub: zmq.Socket, done, wait_s: float = 15.0):
    """Publish every ~10 ms as the worker's loop does, collecting (seq, batch) from `sub` until `done(seen)`."""
    seen: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + wait_s
    while not done(seen) and time.monotonic() < deadline:
        publisher.publish(sink)
        while sub.poll(10):
            _, seq, payload = sub.recv_multipart()
            seen.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    return seen


def opens_clear(batch: KVEventBatch) -> bool:
    return batch.events[:1] == [AllBlocksCleared()]


def test_a_batch_the_relay_cannot_take_is_dropped_and_the_next_is_a_snapshot():
    """The relay is stopped (SIGSTOP) while the worker publishes: `publish` never waits; once the
    channel is full it drops batches without numbering them, and the first batch it sends again
    opens with AllBlocksCleared and holds every block: a subscriber sees gapless numbers and ends
    holding what the sink holds."""
    pub, rep = endpoints()
    publisher, sink = KvEventPublisher(pub, rep), VllmEventSink(16)
    sub = subscriber(pub)
    relay = publisher.relay_pid
    try:
        seen = follow_until(publisher, sink, sub, bool)  # batch 0 or the subscription's snapshot: both open with a clear
        assert seen and opens_clear(seen[0][1])
        sink.stored(b"kept-1", None, tuple(range(16)))
        os.kill(relay, signal.SIGSTOP)
        slowest = 0.0
        for i in range(3000):  # at most ~30 MB into a channel of CHANNEL_QUEUE batches and a socket buffer
            churn(sink, i)
            started = time.monotonic()
            publisher.publish(sink)
            slowest = max(slowest, time.monotonic() - started)
            if publisher.num_dropped > 3:
                break
        assert publisher.num_dropped > 3
        assert slowest < 0.5, slowest  # never blocked on the stopped relay
        sink.stored(b"kept-2", b"kept-1", tuple(range(16, 32)))
        os.kill(relay, signal.SIGCONT)
        seen += follow_until(publisher, sink, sub, lambda s: any(opens_clear(b) and len(b.events) == 3 for _, b in s))
    finally:
        os.kill(relay, signal.SIGCONT)
        sub.close(0)
        publisher.close()
    seqs = [s for s, _ in seen]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # dropped batches took no number
    assert opens_clear(seen[-1][1]), seen[-1]  # the first batch after the drops: AllBlocksCleared, kept-1, kept-2
    media: dict[bytes, set[str]] = {}
    for _, batch in seen:
        apply(media, batch)
    assert media == {b"kept-1": {"GPU"}, b"kept-2": {"GPU"}} == sink.held()


def test_a_relay_that_dies_is_replaced_and_its_replacement_starts_with_a_snapshot(caplog):
    pub, rep = endpoints()
    publisher, sink = KvEventPublisher(pub, rep), VllmEventSink(16)
    sub = subscriber(pub)
    try:
        sink.stored(b"b1", None, tuple(range(16)))
        time.sleep(1.0)  # past RESTART_S since the first relay's start: its replacement starts at once
        before = follow_until(publisher, sink, sub, bool)
        first = publisher.relay_pid
        os.kill(first, signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_events"):
            after = follow_until(publisher, sink, sub, lambda s: any(opens_clear(b) for _, b in s))
        assert publisher.relay_pid != first
        assert any(f"relay (pid {first}) exited (killed by SIGKILL)" in r.getMessage() for r in caplog.records), caplog.text
        seq, snapshot = next((s, b) for s, b in after if opens_clear(b))
        assert seq > before[-1][0]  # the numbers go on
        media: dict[bytes, set[str]] = {}
        apply(media, snapshot)
        assert media == {b"b1": {"GPU"}}
        kept = replayed(rep, lambda k: seq in dict(k))  # the replacement's log opens with a snapshot
        assert kept[0][0] > before[-1][0] and opens_clear(kept[0][1]) and dict(kept)[seq] == snapshot
    finally:
        sub.close(0)
        publisher.close()


def test_a_dead_relays_ports_stay_the_workers_until_its_replacement_takes_them():
    """Found by an adversarial pass: the relay bound the ports itself, so once a flood or a kill
    ended it another local process could bind them (8.5 ms after the kill) and feed the worker's
    subscribers its own batches until it let go. The worker now holds the listening sockets and
    hands them to each relay."""
    pub, rep = endpoints()
    publisher, sink = KvEventPublisher(pub, rep), VllmEventSink(16)
    sub = subscriber(pub)
    try:
        sink.stored(b"b1", None, tuple(range(16)))
        time.sleep(1.0)  # past RESTART_S: the replacement starts at the next publish
        follow_until(publisher, sink, sub, bool)
        first = publisher.relay_pid
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: gone(first))
        for endpoint in (pub, rep):
            intruder = socket.socket()
            intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
            with pytest.raises(OSError, match="Address already in use"):
                intruder.bind(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
            intruder.close()
        after = follow_until(publisher, sink, sub, lambda s: any(opens_clear(b) for _, b in s))
        assert publisher.relay_pid != first and after  # the same subscriber follows the replacement
    finally:
        sub.close(0)
        publisher.close()


HOLDER = """
import sys, time
from pdserve.workers.kv_publisher import KvEventPublisher
publisher = KvEventPublisher(sys.argv[1], sys.argv[2])
print(publisher.relay_pid, flush=True)
time.sleep(600)
"""


def test_the_relay_dies_with_its_worker_killed_by_sigkill():
    pub, rep = endpoints()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, pub, rep], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        relay = int(holder.stdout.readline())
        assert not gone(relay)
    finally:
        holder.kill()
        holder.wait()
    assert wait_until(lambda: gone(relay), 5.0), "the relay outlived its worker"
    assert wait_until(lambda: bindable(int(pub.rsplit(":", 1)[1])), 5.0)  # its ports are free again


def bindable(port: int) -> bool:
    """Whether a listener can bind `port` now (the kernel frees a dead process's sockets a moment
    after the process shows as gone)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_relay_whose_parent_is_already_gone_exits():
    spec = {"parent_pid": 1, "channel": "ipc:///nonexistent", "endpoint": endpoints()[0], "replay_endpoint": None,
            "topic": "", "buffer_batches": 10, "buffer_bytes": 1000, "snapshot_interval_s": 1.0}
    done = subprocess.run([sys.executable, "-m", "pdserve.workers.kv_relay", json.dumps(spec)], timeout=30,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 1


def test_an_endpoint_the_relay_cannot_bind_fails_the_start_with_its_name():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(zmq.ZMQError, match=f"cannot bind tcp://127.0.0.1:{port}: Address already in use"):
            KvEventPublisher(f"tcp://127.0.0.1:{port}")
        pub = endpoints()[0]
        with pytest.raises(zmq.ZMQError, match=f"cannot bind tcp://127.0.0.1:{port}"):  # the replay endpoint alike
            KvEventPublisher(pub, f"tcp://127.0.0.1:{port}")
    assert not [c for c in _children(os.getpid()) if b"kv_relay" in open(f"/proc/{c}/cmdline", "rb").read()]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]
