"""`pdserve bench-transfer --fetch` (commands/bench_fetch.py) on a 1 MiB prefix: both arms move
the same bytes, publish, and the fetch lands every block in the destination's prefix cache."""

from __future__ import annotations

from pdserve.commands.bench_fetch import SMALL_ABI, fetch_vs_handoff


def test_fetch_and_handoff_move_the_same_prefix():
    out = fetch_vs_handoff(2, nbytes=1 << 20)
    blocks = -(-(1 << 20) // SMALL_ABI.bytes_per_block)
    assert out["fetch_bytes"] == blocks * SMALL_ABI.bytes_per_block
    assert len(out["fetch_samples_ms"]["fetch"]) == len(out["fetch_samples_ms"]["handoff"]) == 2
    assert out["fetch_gbps"] > 0 and out["handoff_inproc_gbps"] > 0
