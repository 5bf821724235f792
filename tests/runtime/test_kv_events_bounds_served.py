"""`pdserve serve --kv-events-endpoint ... --kv-events-replay-endpoint ...` (defaults otherwise:
1P1D): what a peer of the unauthenticated KV-events sockets sends must not size what the worker
holds (workers/kv_publisher.py).

Found by an adversarial pass: a peer that subscribes over and over (an XSUB sending b"\\x01")
turned every batch into a snapshot of every held block (~340 KB at 4,096 blocks), each kept in the
10,000-batch replay buffer: a decode worker grew from 563 MB to 3.9 GB. A 300 MB frame on the
replay socket was read in whole. Peers sending 1-byte subscription frames without pause held the
engine thread, which read them all before its next step, for over a minute (the worker was then
replaced as stuck). Now a snapshot goes out at most once a second, the subscription frames are
read by the worker's relay process (workers/kv_relay.py), never on the engine thread, and a frame
over MAX_REQUEST_BYTES disconnects its sender; a well-behaved subscriber and replay client are served throughout, and so are completions
(the engine loop never stands still for `--step-timeout-s` 2 s)."""

from __future__ import annotations

import threading
import time

import httpx
import zmq

from pdserve.workers.kv_publisher import MAX_REQUEST_BYTES
from tests.api.served_cli import serve_logged, stop, wait_healthy
from tests.runtime.conftest import prompt
from tests.runtime.test_kv_events_vllm import DECODE, AllBlocksCleared, free_ports, replay

SPAM_S = 3.0


FLOOD_S = 6.0


def subscription_flood(endpoint: str, seconds: float) -> None:
    """Two peers queueing a million 1-byte subscription frames each (~130 MB here), held open
    `seconds` while the worker takes them: its engine thread read them all before its next step."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.XSUB) for _ in range(2)]
    for s in socks:
        s.setsockopt(zmq.SNDHWM, 0)  # queued here, not dropped: the worker gets every frame
        s.connect(endpoint)
    started = time.monotonic()
    for _ in range(1_000_000):
        for s in socks:
            s.send(b"\x01")
    time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    ctx.destroy(linger=0)


def complete(port: int, ids: list[int]) -> dict:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": ids, "max_tokens": 4, "ignore_eos": True,
                                "temperature": 0.0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


def snapshots_seen_while_spammed(ctx: zmq.Context, endpoint: str) -> int:
    """Batches opening with AllBlocksCleared that a subscriber receives while another peer
    resubscribes every 5 ms for SPAM_S seconds (and for a second after)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    spam = ctx.socket(zmq.XSUB)
    spam.connect(endpoint)
    snapshots = 0
    try:
        deadline, stop_spam = time.monotonic() + SPAM_S + 1.0, time.monotonic() + SPAM_S
        while time.monotonic() < deadline:
            if time.monotonic() < stop_spam:
                spam.send(b"\x01")
            while sub.poll(5):
                _, _, payload = sub.recv_multipart()
                events = DECODE.decode(payload).events
                snapshots += bool(events) and isinstance(events[0], AllBlocksCleared)
    finally:
        sub.close(0)
        spam.close(0)
    return snapshots


def test_resubscribing_and_oversized_frames_do_not_grow_a_worker(tmp_path):
    base = free_ports(4)  # prefill-0 publishes at base, decode-0 at base + 1; replay at base + 2, + 3
    log_path = tmp_path / "serve.log"
    proc, port = serve_logged(log_path, "--kv-events-endpoint", f"tcp://127.0.0.1:{base}",
                              "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{base + 2}", "--step-timeout-s", "2")
    ctx = zmq.Context()
    try:
        wait_healthy(port, 180.0)
        for seed in range(3):  # blocks for the snapshots to carry
            complete(port, list(prompt(80, seed)))
        snapshots = snapshots_seen_while_spammed(ctx, f"tcp://127.0.0.1:{base + 1}")
        # one a second at most (the subscriber's own first one included); before: one per worker loop turn
        assert 1 <= snapshots <= SPAM_S + 2, snapshots

        big = ctx.socket(zmq.DEALER)  # a frame over the bound: its sender is disconnected, never answered
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"tcp://127.0.0.1:{base + 3}")
        big.send_multipart((b"", b"\0" * (MAX_REQUEST_BYTES + 1)))
        assert not big.poll(2000)
        big.close(0)

        kept = replay(ctx, f"tcp://127.0.0.1:{base + 3}", 0)  # a well-formed request is still answered
        seqs = [seq for seq, _ in kept]
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert complete(port, list(prompt(80, 0)))["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        flood = threading.Thread(target=subscription_flood, args=(f"tcp://127.0.0.1:{base + 1}", FLOOD_S), daemon=True)
        flood.start()
        time.sleep(1.0)
        assert complete(port, list(prompt(40, 9)))["choices"][0]["finish_reason"] == "length"  # served meanwhile
        flood.join(FLOOD_S + 10)
        time.sleep(3.0)  # a loop held past the flood would show now
        assert "has not come round" not in log_path.read_text()
    finally:
        stop(proc)
        ctx.destroy(linger=0)
