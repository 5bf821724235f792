"""The process that owns a worker's external KV-events sockets: `python -m pdserve.workers.kv_relay
SPEC_JSON`, started and restarted by the worker's publisher (workers/kv_publisher.py).

Why a process of its own: libzmq cannot bound what an unauthenticated peer makes the process
holding an XPUB or ROUTER socket keep. A multipart message of small frames that never ends is
held whole (the high-water mark counts complete messages; MAXMSGSIZE is checked per frame), and
an XPUB takes every subscription frame into its own queue and trie, processed in whichever thread
next uses the socket: a flood of distinct topics grew a worker by ~40x the bytes sent and held its
engine thread for 5-9 s. Here that thread is this process's, and what it can hold is capped.

Contract:
- the channel (a ZMQ PAIR over ipc:// in the worker's 0700 directory; the relay connects) carries
  worker -> relay [sequence as 8 big-endian bytes, msgpack KVEventBatch], published as
  [topic, sequence, payload] on the XPUB and kept for replay, and relay -> worker one-frame notes:
  b"bound" once both endpoints are bound, b"error ERRNO TEXT" when one cannot be (the relay then
  exits 1), b"joined" when a subscription arrived: at most one per `snapshot_interval_s` (a later
  subscription is noted when the interval has passed);
- replay (ROUTER): a request [start sequence, 8 big-endian bytes] gets one [sequence, payload] per
  kept batch from that number on, then [END_OF_REPLAY, empty] (a request it cannot read gets the
  end marker alone); the channel is read before each request is answered;
- bounds: the replay buffer keeps `buffer_batches` batches and `buffer_bytes` bytes at most, the
  oldest dropped; a replay peer that does not read is sent REPLAY_QUEUE messages at most (the rest
  of its answer is dropped); a frame over MAX_REQUEST_BYTES on either socket disconnects its
  sender; the process runs at nice +NICE, and its data segment (RLIMIT_DATA) is capped at its size
  once bound plus `buffer_bytes` plus SLACK_BYTES, so a flood ends it (an allocation fails) instead
  of growing the machine; it dumps no core;
- life: it dies with the thread that started it (`lifetime.die_with_parent`: PR_SET_PDEATHSIG
  SIGKILL, checked against the parent pid it was given, in case that parent is already gone) and
  on SIGTERM (the worker's close). Nothing here imports more than zmq and the standard library: it starts in ~60 ms.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from collections import deque

import zmq

from pdserve.lifetime import die_with_parent

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_REQUEST_BYTES = 4096  # a replay request is 8 bytes, a subscription 1 + the topic
REPLAY_QUEUE = 100  # messages queued to one replay peer at the most
CHANNEL_QUEUE = 256  # batches in flight from the worker at the most (past it the worker drops and resyncs)
NOTES_QUEUE = 16  # notes in flight to the worker at the most
SLACK_BYTES = 128 << 20  # room over the replay buffer for connections, queues and the interpreter
NICE = 10
TURN = 256  # frames read from one socket before the others get a turn


class Relay:
    def __init__(self, spec: dict, ctx: zmq.Context):
        self.ctx = ctx
        self.channel = ctx.socket(zmq.PAIR)
        self.channel.setsockopt(zmq.LINGER, 1000)  # an error note must reach the worker before the exit
        self.channel.setsockopt(zmq.RCVHWM, CHANNEL_QUEUE)
        self.channel.setsockopt(zmq.SNDHWM, NOTES_QUEUE)
        self.channel.connect(spec["channel"])
        self.topic = spec["topic"].encode()
        self.buffer: deque[tuple[bytes, bytes]] = deque(maxlen=spec["buffer_batches"])
        self.buffer_bytes, self.max_buffer_bytes = 0, spec["buffer_bytes"]
        self.interval_s = spec["snapshot_interval_s"]
        self.last_note, self.note_due = -float("inf"), False
        self.pub = ctx.socket(zmq.XPUB)  # a PUB that hears each (re)subscription
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's, not only a topic's first
        self.replay = ctx.socket(zmq.ROUTER) if spec["replay_endpoint"] else None
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if self.replay is not None:
            self.replay.setsockopt(zmq.SNDHWM, REPLAY_QUEUE)
        self.bind(self.pub, spec["endpoint"], spec.get("pub_fd"))
        if self.replay is not None:
            self.bind(self.replay, spec["replay_endpoint"], spec.get("replay_fd"))

    def bind(self, sock: zmq.Socket, endpoint: str, fd: int | None) -> None:
        """Bind `endpoint`, on the worker's listening socket `fd` when it gave one (ZMQ_USE_FD)."""
        try:
            if fd is not None:
                sock.setsockopt(zmq.USE_FD, fd)
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.channel.send(f"error {exc.errno} {endpoint}: {exc.strerror}".encode())
            for other in (self.pub, self.replay):
                if other is not None:
                    other.close(0)
            self.channel.close()  # lingers until the note is out (or a second has passed)
            self.ctx.term()
            raise SystemExit(1) from None

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.channel, self.pub, self.replay):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while True:
            wait_s = self.last_note + self.interval_s - time.monotonic() if self.note_due else None
            ready = dict(poller.poll(None if wait_s is None else max(0, int(wait_s * 1000) + 1)))
            self.take_batches()  # first: a replay request sees every batch sent before it
            if ready.get(self.pub):
                self.note_due |= self.subscribed()
            if self.replay is not None and ready.get(self.replay):
                self.answer()
            self.note()

    def take_batches(self) -> None:
        for _ in range(TURN):
            try:
                seq, payload = self.channel.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(self.buffer) == self.buffer.maxlen:
                self.buffer_bytes -= len(self.buffer[0][1])
            self.buffer.append((seq, payload))
            self.buffer_bytes += len(payload)
            while self.buffer_bytes > self.max_buffer_bytes and len(self.buffer) > 1:
                self.buffer_bytes -= len(self.buffer.popleft()[1])
            self.pub.send_multipart((self.topic, seq, payload), copy=False)  # not copied: shares the buffer's bytes

    def subscribed(self) -> bool:
        """Whether a subscription (b"\\x01" + topic) is among the next TURN frames; unsubscriptions
        and other frames are read and ignored."""
        joined = False
        for _ in range(TURN):
            try:
                joined |= self.pub.recv(zmq.NOBLOCK)[:1] == b"\x01"
            except zmq.Again:
                break
        return joined

    def note(self) -> None:
        if self.note_due and time.monotonic() - self.last_note >= self.interval_s:
            try:
                self.channel.send(b"joined", zmq.NOBLOCK)
            except zmq.Again:  # the worker is not reading: noted on a later turn
                return
            self.note_due, self.last_note = False, time.monotonic()

    def answer(self) -> None:
        """Reply to [identity, (empty delimiter: a REQ client), start as 8 big-endian bytes] with
        the kept batches from `start` on, then the end marker. Any other request gets the end
        marker alone (vLLM's replay drops it unanswered, leaving its client waiting for good)."""
        try:
            frames = self.replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        delimited = len(frames) >= 3 and frames[1] == b""
        envelope, request = (frames[:2], frames[2:]) if delimited else (frames[:1], frames[1:])
        kept = []
        if len(request) == 1 and len(request[0]) == 8:
            start = int.from_bytes(request[0], "big")
            kept = [(s, p) for s, p in self.buffer if int.from_bytes(s, "big") >= start]
        for seq, payload in kept:  # not copied: every peer's queue refers to the buffer's bytes
            self.replay.send_multipart((*envelope, seq, payload), copy=False)
        self.replay.send_multipart((*envelope, END_OF_REPLAY, b""))


def cap_memory(extra_bytes: int) -> None:
    """Cap the data segment at its present size plus `extra_bytes` (RLIMIT_DATA counts heap and
    private writable mappings, so it binds libzmq's buffers and Python's objects alike)."""
    with open("/proc/self/status") as f:
        data_kib = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    soft = (data_kib << 10) + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    die_with_parent(spec["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker ends this process, not a terminal's Ctrl-C
    os.nice(NICE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an allocation that fails aborts libzmq: no core file
    relay = Relay(spec, zmq.Context())
    cap_memory(spec["buffer_bytes"] + SLACK_BYTES)
    relay.channel.send(b"bound")
    relay.run()


if __name__ == "__main__":
    main(sys.argv[1:])
