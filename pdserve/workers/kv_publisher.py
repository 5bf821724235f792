"""A worker's prefix-cache events in vLLM's KV-events wire format, published through a relay process.

Contract (vLLM's `ZmqEventPublisher`, so its subscribers work unchanged): each batch is one
multipart message [topic, sequence number as 8 big-endian bytes, msgpack `KVEventBatch`
(engine/kv/vllm_events.py)] on a PUB socket, numbered from 0 upwards with no gaps; the last
`buffer_batches` messages are kept for replay: a ROUTER socket answers a request [start sequence,
8 big-endian bytes] with one [sequence, payload] reply per kept message from that number on, then
[-1, empty payload] as the end marker (a request it cannot read gets the end marker alone).
Numbers restart at 0 with each worker process, as vLLM's do, and batch 0 opens with
AllBlocksCleared. A subscriber that reconnects to a restarted worker misses what was sent before
its subscription arrived (PUB/SUB drops it), so a subscription turns the next batch into a
snapshot: AllBlocksCleared, then a BlockStored per held block and tier.

Structure: the external sockets and the replay buffer live in a relay process
(workers/kv_relay.py: libzmq cannot bound what a peer of an XPUB or ROUTER makes its process hold,
so that process is not the worker's). The worker numbers the batches and builds the snapshots;
`publish(sink)` runs on its engine thread and never blocks it: it sends (sequence, payload) over a
private channel (a ZMQ PAIR over ipc:// in a 0700 directory) holding CHANNEL_QUEUE batches at most,
and reads the relay's notes without waiting. A batch the channel cannot take (the relay is not
keeping up, or is being restarted) is dropped without using its number, and the next batch sent is
a snapshot, so subscribers resync. A subscription note comes at most once per
`snapshot_interval_s` however often peers subscribe (the relay rate-limits). Each publish checks
the relay's process: one that has exited is logged with its exit status and replaced (at most once
per RESTART_S), and the replacement's first batch is a snapshot; its replay buffer starts empty and
the numbers go on. The relay dies with the thread that started it (PR_SET_PDEATHSIG: the worker builds
the publisher and runs its loop on one thread, which lives as long as the worker) and with
`close()`. The worker binds the listening sockets itself and keeps them for its life; each relay
serves them (ZMQ_USE_FD), so no other process can take a port while a relay is being replaced. An
endpoint that cannot be bound fails the publisher's construction (zmq.ZMQError naming it), and so
the worker's start.

Bounds: what the worker holds for KV events is the sink's pending events of one turn and the
channel's CHANNEL_QUEUE batches; the relay's bounds are in workers/kv_relay.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from pdserve.engine.kv.vllm_events import VllmEventSink
from pdserve.lifetime import describe_exit
from pdserve.workers.kv_relay import CHANNEL_QUEUE, END_OF_REPLAY, MAX_REQUEST_BYTES, NOTES_QUEUE, REPLAY_QUEUE

__all__ = ["END_OF_REPLAY", "MAX_REQUEST_BYTES", "REPLAY_QUEUE", "KvEventPublisher", "check_endpoints", "endpoint_for"]

log = logging.getLogger("pdserve.kv_events")

RESTART_S = 1.0  # a relay that died is replaced at most this often
LISTEN_BACKLOG = 100  # libzmq's own for a TCP listener
START_TIMEOUT_S = 30.0  # how long the first relay may take to bind (a loaded 2-core machine)
NOTES_PER_TURN = NOTES_QUEUE  # relay notes read per publish at the most


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
        self._spec = {"endpoint": endpoint, "replay_endpoint": replay_endpoint, "topic": topic,
                      "buffer_batches": buffer_batches, "buffer_bytes": buffer_bytes,
                      "snapshot_interval_s": snapshot_interval_s, "parent_pid": os.getpid()}
        self._ctx = zmq.Context.instance()
        self._dir: str | None = None  # the channel's directory, until the relay has connected
        self._encoder = msgspec.msgpack.Encoder()
        self._seq, self._resync = 0, False
        self.num_dropped = 0  # batches the channel could not take (each followed by a snapshot)
        self._relay: subprocess.Popen | None = None
        self._channel: zmq.Socket | None = None
        self._ready, self._started_at = False, -float("inf")
        self._listeners: list[socket.socket] = []
        try:
            for key, address in (("pub_fd", endpoint), ("replay_fd", replay_endpoint)):
                if address is not None:
                    self._listeners.append(_listen(address))
                    self._spec[key] = self._listeners[-1].fileno()
            self._start()
            self._await_bound()
        except BaseException:
            self.close()
            raise

    @property
    def relay_pid(self) -> int:
        return self._relay.pid

    def publish(self, sink: VllmEventSink) -> None:
        """Send the sink's pending events as one batch (nothing when there are none); the whole
        state instead after a subscription note, a dropped batch or a relay restart."""
        self._watch()
        self._read_notes()
        if not self._ready or not self._channel.poll(0, zmq.POLLOUT):
            if sink.take() is not None:  # dropped: the relay is not keeping up, or is being replaced
                self._resync, self.num_dropped = True, self.num_dropped + 1
            return
        if self._resync:
            sink.snapshot()
            self._resync = False
        batch = sink.take()
        if batch is None:
            return
        try:
            self._channel.send_multipart((self._seq.to_bytes(8, "big"), self._encoder.encode(batch)),
                                         zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._resync, self.num_dropped = True, self.num_dropped + 1
            return
        self._seq += 1

    def _start(self) -> None:
        """A relay with a channel of its own (a fresh PAIR: nothing of a dead relay's queue stays)."""
        self._close_channel()
        self._dir = tempfile.mkdtemp(prefix="pdserve-kv-relay-")  # mode 0700: no other user reaches the channel
        address = f"ipc://{self._dir}/channel"
        channel = self._ctx.socket(zmq.PAIR)
        channel.setsockopt(zmq.LINGER, 0)
        channel.setsockopt(zmq.SNDHWM, CHANNEL_QUEUE)
        channel.setsockopt(zmq.RCVHWM, NOTES_QUEUE)
        channel.bind(address)
        self._channel, self._ready, self._started_at = channel, False, time.monotonic()
        root = str(Path(__file__).resolve().parents[2])  # the tree this module is from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._relay = subprocess.Popen([sys.executable, "-m", "pdserve.workers.kv_relay",
                                        json.dumps({**self._spec, "channel": address})],
                                       stdin=subprocess.DEVNULL, env=env, pass_fds=[s.fileno() for s in self._listeners])

    def _await_bound(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready:
            exited = self._relay.poll() is not None
            if self._channel.poll(200 if not exited else 1000):
                self._handle(self._channel.recv(), starting=True)
            elif exited:
                raise zmq.ZMQError(msg=f"KV events: the relay exited ({describe_exit(self._relay.returncode)}) before it bound "
                                       f"{self._spec['endpoint']}")
            elif time.monotonic() > deadline:
                raise zmq.ZMQError(msg=f"KV events: the relay did not bind {self._spec['endpoint']} in {START_TIMEOUT_S:.0f} s")

    def _watch(self) -> None:
        """Replace a relay that has exited (at most once per RESTART_S)."""
        if self._relay.poll() is None:
            return
        if self._channel is not None:
            log.warning("KV events: the relay (pid %d) exited (%s); starting another", self._relay.pid,
                        describe_exit(self._relay.returncode))
            self._close_channel()
        if time.monotonic() - self._started_at >= RESTART_S:
            try:
                self._start()
            except (OSError, zmq.ZMQError) as exc:
                self._started_at = time.monotonic()
                log.warning("KV events: cannot start a relay: %s", exc)

    def _read_notes(self) -> None:
        for _ in range(NOTES_PER_TURN):
            if self._channel is None or not self._channel.poll(0):
                return
            self._handle(self._channel.recv())

    def _handle(self, note: bytes, starting: bool = False) -> None:
        self._remove_dir()  # the relay has connected: the path is not needed again (nor left behind by a kill -9)
        if note == b"bound":
            self._ready = True
            self._resync |= self._seq > 0  # a replacement: its subscribers start from a snapshot
        elif note == b"joined":
            self._resync = True
        elif note.startswith(b"error "):
            errno, text = note.decode(errors="replace").split(" ", 2)[1:]
            if starting:
                raise zmq.ZMQError(int(errno), f"KV events: cannot bind {text}")
            log.warning("KV events: the relay cannot bind %s", text)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close(0)
            self._channel, self._ready = None, False
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def close(self) -> None:
        """End the relay (SIGKILL: it keeps nothing worth a clean exit, and a stopped one would
        take no SIGTERM), the channel and the listening sockets."""
        relay, self._relay = self._relay, None
        if relay is not None and relay.poll() is None:
            relay.kill()
            relay.wait()
        self._close_channel()
        for listener in self._listeners:
            listener.close()
        self._listeners = []


def _listen(endpoint: str) -> socket.socket:
    """A listening TCP socket on `endpoint` (tcp://HOST:PORT; HOST `*` for every interface), held by
    the worker for its life and handed to each relay (ZMQ_USE_FD): between a relay's death and its
    replacement the port stays the worker's, so no other process can bind it and take its
    subscribers. Raises zmq.ZMQError naming the endpoint when it cannot be bound."""
    host, port = _split(endpoint)
    host = host.removeprefix("tcp://").strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(None if host in ("*", "") else host, port,
                                                             type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise zmq.ZMQError(exc.errno or 0, f"KV events: cannot bind {endpoint}: {exc.strerror or exc}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq's own listener
        listener.bind(address)
        listener.listen(LISTEN_BACKLOG)
    except OSError as exc:
        listener.close()
        raise zmq.ZMQError(exc.errno or 0, f"KV events: cannot bind {endpoint}: {exc.strerror}") from None
    listener.set_inheritable(True)
    return listener
