"""`pdserve serve --kv-events-endpoint ... --kv-events-replay-endpoint ...` (defaults otherwise:
1P1D): what a peer of the unauthenticated KV-events sockets sends must not size what the worker
holds (workers/kv_publisher.py).

Found by an adversarial pass: a peer that subscribes over and over (an XSUB sending b"\\x01")
turned every batch into a snapshot of every held block (~340 KB at 4,096 blocks), each kept in the
10,000-batch replay buffer: a decode worker grew from 563 MB to 3.9 GB. A 300 MB frame on the
replay socket was read in whole. Now a snapshot goes out at most once a second, and a frame over
MAX_REQUEST_BYTES disconnects its sender; a well-behaved subscriber and replay client are served
throughout, and so are completions."""

from __future__ import annotations

import time

import httpx
import zmq

from pdserve.workers.kv_publisher import MAX_REQUEST_BYTES
from tests.api.served_cli import serve_logged, stop, wait_healthy
from tests.runtime.conftest import prompt
from tests.runtime.test_kv_events_vllm import DECODE, AllBlocksCleared, free_ports, replay

SPAM_S = 3.0


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
    proc, port = serve_logged(tmp_path / "serve.log", "--kv-events-endpoint", f"tcp://127.0.0.1:{base}",
                              "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{base + 2}")
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
    finally:
        stop(proc)
        ctx.destroy(linger=0)
