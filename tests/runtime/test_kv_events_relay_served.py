"""`pdserve serve --kv-events-endpoint ... --kv-events-replay-endpoint ...` (1P1D): floods of the
unauthenticated KV-events sockets land in each worker's relay process (workers/kv_relay.py), not
in the worker: the worker's RSS stays within WORKER_GROWTH_MIB, its engine loop keeps turning
(`--step-timeout-s 2` never fires, streams keep their pace), and once the flood ends a vLLM-style
subscriber and replay client follow the worker again.

Found by an adversarial pass (libzmq bounds neither): F1, a multipart message of 4 KiB frames that
never ends (MAXMSGSIZE is checked per frame, the high-water mark counts complete messages) grew a
worker ~2 bytes per byte sent, on either socket, and kept it after the peer left; F2, 4 KiB
subscriptions to distinct topics, taken by the XPUB into its queue and trie in the thread that
uses the socket (the engine thread), grew a decode worker ~40x the bytes sent and held its engine
loop 4.6-9.2 s. The peers here speak raw ZMTP 3.0, so every frame leaves as written."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import httpx
import zmq

from tests.api.served_cli import serve_logged, stop, wait_healthy
from tests.runtime.conftest import prompt
from tests.runtime.test_kv_events_bounds_served import complete
from tests.runtime.test_kv_events_vllm import DECODE, AllBlocksCleared, free_ports, replay

WORKER_GROWTH_MIB = 100  # what the floods may add to the worker's RSS
F1_MIB, F2_MIB = 48, 16  # sent per flood (before: ~96 MiB and ~640 MiB of worker growth)
MAX_GAP_S = 2.0  # between a stream's events (5-12 ms here unloaded; the F2 flood held the loop 4.6-9.2 s)
FRAME = 4096  # MAX_REQUEST_BYTES: the largest frame a KV-events socket takes


def zmtp_frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = int(more) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_connect(port: int, socket_type: bytes) -> socket.socket:
    """A ZMTP 3.0 peer of `socket_type` (NULL security) past the handshake."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31))
    greeting = b""
    while len(greeting) < 64:
        chunk = sock.recv(64 - len(greeting))
        if not chunk:
            raise ConnectionError("closed during the greeting")
        greeting += chunk
    name = b"Socket-Type"
    sock.sendall(zmtp_frame(b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type,
                            command=True))
    return sock


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10


def flood(port: int, socket_type: bytes, chunk, budget_mib: int, pid: int, stop_above_mib: int,
          seconds: float = 20.0) -> dict:
    """Send `budget_mib` MiB of `chunk()` (1 MiB each) to `port`, reconnecting when the peer goes
    (a relay that died is replaced within seconds); stop early once `pid`'s RSS passes
    `stop_above_mib` (the unfixed worker: the test must not grow the machine) or after `seconds`."""
    sent, drops, peak = 0, 0, rss_mib(pid)
    deadline = time.monotonic() + seconds
    sock = None
    while sent < budget_mib and peak <= stop_above_mib and time.monotonic() < deadline:
        try:
            sock = sock or zmtp_connect(port, socket_type)
            sock.sendall(chunk())
            sent += 1
        except OSError:
            drops += 1
            if sock is not None:
                sock.close()
            sock = None
            time.sleep(0.05)
        peak = max(peak, rss_mib(pid))
    if sock is not None:
        sock.close()
    return {"sent_mib": sent, "reconnects": drops, "peak_mib": peak}


def unterminated(first: bytes) -> callable:
    """F1: 1 MiB of 4 KiB frames, each flagged MORE: one message that never ends."""
    body = first + b"x" * (FRAME - len(first))
    block = zmtp_frame(body, more=True) * 256
    return lambda: block


def distinct_topics() -> bytes:
    """F2: 1 MiB of complete 4 KiB subscriptions, each to a topic of its own."""
    return b"".join(zmtp_frame(b"\x01" + os.urandom(8) + b"t" * (FRAME - 9)) for _ in range(256))


def stream_gaps(port: int, done: threading.Event, gaps: list[float], errors: list[str]) -> None:
    """Greedy streams one after another until `done`: the longest pause between two of a stream's events."""
    body = {"model": "tiny", "prompt": list(prompt(24, 5)), "max_tokens": 48, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    while not done.is_set():
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
                last = None
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
        except httpx.HTTPError as exc:
            errors.append(repr(exc))


def worker_pids(port: int) -> dict[str, int]:
    return {w["id"]: w["pid"] for w in httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()}


def relays(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    out = []
    for c in children:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"kv_relay" in f.read():
                    out.append(c)
        except OSError:
            pass
    return out


def follows(ctx: zmq.Context, pub: str, rep: str, port: int) -> None:
    """A vLLM-style subscriber gets a snapshot once it subscribes, then the next batches numbered
    on from it; the replay socket answers with gapless numbers."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        seen = []
        deadline = time.monotonic() + 20  # a relay the flood ended is replaced within a second or two
        while not seen and time.monotonic() < deadline:
            if sub.poll(200):
                _, seq, payload = sub.recv_multipart()
                seen.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
        assert seen and seen[0][1].events[:1] == [AllBlocksCleared()], seen
        complete(port, list(prompt(80, 11)))
        while sub.poll(2000):
            _, seq, payload = sub.recv_multipart()
            seen.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
        seqs = [s for s, _ in seen]
        assert len(seqs) > 1 and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    finally:
        sub.close(0)
    kept = [s for s, _ in replay(ctx, rep, 0)]
    assert kept and kept == list(range(kept[0], kept[0] + len(kept))) and kept[-1] >= seqs[-1], (kept, seqs)


def test_floods_of_the_kv_event_sockets_do_not_grow_or_hold_the_worker(tmp_path):
    base = free_ports(4)  # prefill-0 publishes at base, decode-0 at base + 1; replay at base + 2, + 3
    pub_port, rep_port = base + 1, base + 3
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, "--kv-events-endpoint", f"tcp://127.0.0.1:{base}",
                              "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{base + 2}", "--step-timeout-s", "2")
    ctx = zmq.Context()
    done, gaps, errors = threading.Event(), [], []
    probe = threading.Thread(target=stream_gaps, args=(port, done, gaps, errors), daemon=True)
    try:
        wait_healthy(port, 180.0)
        for seed in range(3):  # blocks for the snapshots to carry
            complete(port, list(prompt(80, seed)))
        worker = worker_pids(port)["decode-0"]
        before = rss_mib(worker)
        limit = before + 2 * WORKER_GROWTH_MIB
        probe.start()
        time.sleep(0.5)
        results = {
            "F1 replay": flood(rep_port, b"DEALER", unterminated(b""), F1_MIB, worker, limit),
            "F1 pub": flood(pub_port, b"XSUB", unterminated(b"\x01"), F1_MIB, worker, limit),
            "F2 distinct": flood(pub_port, b"XSUB", distinct_topics, F2_MIB, worker, limit),
        }
        assert complete(port, list(prompt(40, 9)))["choices"][0]["finish_reason"] == "length"  # served meanwhile
        done.set()
        probe.join(60)
        after = rss_mib(worker)
        relay = relays(worker)
        report = (f"worker {worker}: {before} -> {after} MiB; relay {relay} "
                  f"{[rss_mib(r) for r in relay]} MiB; floods {results}; longest gap {max(gaps, default=0):.3f} s")
        print(report)
        assert all(r["sent_mib"] > 0 for r in results.values()), report
        assert max(r["peak_mib"] for r in results.values()) - before < WORKER_GROWTH_MIB, report
        assert after - before < WORKER_GROWTH_MIB, report
        assert not errors and len(gaps) > 50 and max(gaps) < MAX_GAP_S, (errors, report)
        assert "has not come round" not in log_path.read_text()
        follows(ctx, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}", port)
        assert worker_pids(port)["decode-0"] == worker  # the same worker throughout: never replaced
    finally:
        done.set()
        stop(proc)
        ctx.destroy(linger=0)
