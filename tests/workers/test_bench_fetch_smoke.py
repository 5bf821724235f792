"""`pdserve bench-transfer --fetch` (commands/bench_fetch.py) on a 1 MiB prefix: every arm moves
the same bytes, publishes, and the fetch lands every block in the destination's prefix cache, from
the holder's device pool and (read in place, nothing promoted) from its host tier."""

from __future__ import annotations

from pdserve.commands.bench_fetch import SMALL_ABI, fetch_vs_handoff


def test_fetch_and_handoff_move_the_same_prefix():
    out = fetch_vs_handoff(2, nbytes=1 << 20)
    blocks = -(-(1 << 20) // SMALL_ABI.bytes_per_block)
    assert out["fetch_bytes"] == blocks * SMALL_ABI.bytes_per_block
    assert [len(v) for v in out["fetch_samples_ms"].values()] == [2, 2, 2, 2]  # fetch, handoff, fetch_host, memcpy
    assert out["fetch_gbps"] > 0 and out["handoff_inproc_gbps"] > 0 and out["fetch_host_gbps"] > 0
