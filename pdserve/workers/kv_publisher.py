"""A worker's prefix-cache events on a ZeroMQ PUB socket in vLLM's KV-events wire format.

Contract (vLLM's `ZmqEventPublisher`, so its subscribers work unchanged): each batch is one
multipart message [topic, sequence number as 8 big-endian bytes, msgpack `KVEventBatch`
(engine/kv/vllm_events.py)], numbers from 0 upwards with no gaps. The last `buffer_batches` messages
are kept for replay: a ROUTER socket answers a request [start sequence, 8 big-endian bytes] with
one [sequence, payload] reply per kept message from that number on, then [-1, empty payload]
as the end marker (a request it cannot read gets the end marker alone). Numbers restart at 0 with
each worker process, as vLLM's do, and batch 0 opens with AllBlocksCleared; since a subscriber
that reconnects to a restarted worker misses what was sent before its subscription arrived (PUB/SUB
drops it), each subscription (the socket is an XPUB) turns the next batch into a snapshot:
AllBlocksCleared, then a BlockStored per held block and tier. `publish(sink)` runs on
the worker's engine thread; replay requests are served by a daemon thread under a lock shared
with `publish`.

Bounds (neither socket is authenticated, as vLLM's are not, so what a peer sends must not size
what the worker holds): a snapshot is sent at most once per `snapshot_interval_s` however often
peers subscribe (a later subscription is answered by the next one; a snapshot of 4,096 held
blocks is ~340 KB, and one per batch let a resubscribing peer grow a worker by gigabytes), and a
turn of the engine thread reads at most SUBSCRIPTIONS_PER_TURN subscription frames; the
replay buffer keeps at most `buffer_batches` batches and `buffer_bytes` bytes, dropping the
oldest; a replay answer shares the buffer's payloads rather than copying them per peer, and a peer
that does not read is sent at most `REPLAY_QUEUE` messages (the rest of its answer, end marker
included, is dropped, as ZeroMQ drops past a peer's queue); a frame larger than `MAX_REQUEST_BYTES`
on either socket (a subscription or a replay request) disconnects its sender.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import msgspec
import zmq

from pdserve.engine.kv.vllm_events import VllmEventSink

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_REQUEST_BYTES = 4096  # a replay request is 8 bytes, a subscription 1 + the topic
REPLAY_QUEUE = 100  # messages queued to one replay peer at the most
SUBSCRIPTIONS_PER_TURN = 64  # subscription frames read per publish (the engine thread's turn) at the most


def _split(base: str) -> tuple[str, int]:
    head, _, port = base.rpartition(":")
    if not head or not port.isdigit():
        raise ValueError(f"a KV-events endpoint is tcp://HOST:PORT, got {base!r}")
    return head, int(port)


def endpoint_for(base: str, index: int) -> str:
    """Worker `index`'s endpoint: `base`'s port plus the index (one socket per worker, as vLLM
    offsets data-parallel ranks), e.g. tcp://127.0.0.1:5557 -> tcp://127.0.0.1:5558 for index 1."""
    head, port = _split(base)
    return f"{head}:{port + index}"


def check_endpoints(endpoint: str | None, replay_endpoint: str | None, num_workers: int) -> None:
    """Refuse (ValueError), before any worker starts, endpoints whose per-worker ports (base ..
    base + num_workers - 1) run past 65535 or whose two ranges share a port: a worker that cannot
    bind dies at start and would only show as a worker that never registered. Ports are compared
    whatever the hosts (a wildcard host binds every interface)."""
    ports = {}
    for flag, base in (("--kv-events-endpoint", endpoint), ("--kv-events-replay-endpoint", replay_endpoint)):
        if base is not None:
            first = _split(base)[1]
            ports[flag] = range(first, first + num_workers)
            if not 0 < first or first + num_workers - 1 > 65535:
                raise ValueError(f"{flag} {base}: its {num_workers} workers need ports {first}..{first + num_workers - 1}, "
                                 f"outside 1..65535")
    if len(ports) == 2:
        pub, rep = ports.values()
        if pub.start < rep.stop and rep.start < pub.stop:
            raise ValueError(f"--kv-events-endpoint ports {pub.start}..{pub.stop - 1} and --kv-events-replay-endpoint "
                             f"ports {rep.start}..{rep.stop - 1} overlap (worker i binds each base port + i): put the "
                             f"two bases at least {num_workers} apart")


class KvEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, buffer_bytes: int = 64 << 20, snapshot_interval_s: float = 1.0):
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)  # a PUB that hears each (re)subscription
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's, not only a topic's first
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._pub.bind(endpoint)
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._buffer_bytes, self._max_buffer_bytes = 0, buffer_bytes
        self._seq = 0
        self._snapshot_due, self._snapshot_interval_s = False, snapshot_interval_s
        self._last_snapshot = -float("inf")
        self._lock = threading.Lock()
        self._replay = None
        self._running = True
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            self._replay.setsockopt(zmq.SNDHWM, REPLAY_QUEUE)
            self._replay.bind(replay_endpoint)
            threading.Thread(target=self._serve_replay, daemon=True, name="kv-events-replay").start()

    def publish(self, sink: VllmEventSink) -> None:
        """Send the sink's pending events as one batch (nothing when there are none); the whole
        state instead when a subscriber subscribed since the last snapshot and the interval since
        it has passed."""
        self._snapshot_due |= self._subscribed()
        now = time.monotonic()
        if self._snapshot_due and now - self._last_snapshot >= self._snapshot_interval_s:
            sink.snapshot()
            self._snapshot_due, self._last_snapshot = False, now
        batch = sink.take()
        if batch is None:
            return
        payload = self._encoder.encode(batch)
        with self._lock:
            seq = self._seq
            self._seq += 1
            if len(self._buffer) == self._buffer.maxlen:
                self._buffer_bytes -= len(self._buffer[0][1])
            self._buffer.append((seq, payload))
            self._buffer_bytes += len(payload)
            while self._buffer_bytes > self._max_buffer_bytes and len(self._buffer) > 1:
                self._buffer_bytes -= len(self._buffer.popleft()[1])
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)

    def _subscribed(self) -> bool:
        """Whether a subscription arrived (b"\\x01" + topic); unsubscriptions are ignored. At most
        SUBSCRIPTIONS_PER_TURN frames are read a turn (this runs on the engine thread: peers sending
        millions of 1-byte frames held it for a minute; the rest wait for later turns)."""
        joined = False
        for _ in range(SUBSCRIPTIONS_PER_TURN):
            if not self._pub.poll(0):
                break
            joined |= self._pub.recv()[:1] == b"\x01"
        return joined

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while self._running:
            try:
                if not poller.poll(100):
                    continue
                self._answer(self._replay.recv_multipart())
            except zmq.ZMQError:
                break
        self._replay.close(0)  # this thread owns the socket: closed here, never from another thread

    def _answer(self, frames: list[bytes]) -> None:
        """Reply to [identity, (empty delimiter: a REQ client), start as 8 big-endian bytes] with
        the kept batches from `start` on, then the end marker. Any other request gets the end
        marker alone (vLLM's replay drops it unanswered, leaving its client waiting for good)."""
        delimited = len(frames) >= 3 and frames[1] == b""
        envelope, request = (frames[:2], frames[2:]) if delimited else (frames[:1], frames[1:])
        kept = []
        if len(request) == 1 and len(request[0]) == 8:
            start = int.from_bytes(request[0], "big")
            with self._lock:
                kept = [(s, p) for s, p in self._buffer if s >= start]
        for seq, payload in kept:  # not copied: every peer's queue refers to the buffer's bytes
            self._replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload), copy=False)
        self._replay.send_multipart((*envelope, END_OF_REPLAY, b""))

    def close(self) -> None:
        self._running = False
        self._pub.close(0)
