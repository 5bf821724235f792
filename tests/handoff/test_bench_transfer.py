"""The bench-transfer command registers cheaply and its handoff runner works on a small geometry."""

from __future__ import annotations

from pdserve.cli import build_parser
from pdserve.commands import bench_transfer as bench
from pdserve.engine.kv_abi import KvAbi


def test_command_registers():
    args = build_parser().parse_args(["bench-transfer", "--json", "--runs", "2"])
    assert args.func is bench.run and args.json and args.runs == 2


def test_small_handoffs_through_both_transports():
    abi = KvAbi(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
    rig = bench._Rig(abi, 40, blocks_per_chunk=3)
    try:
        for kind in ("shm", "tcp"):
            assert bench.bench_handoff(rig, kind, runs=1) > 0
        timing = bench.bench_exposed(rig, "tcp", prefill_s=0.02, runs=1)
        assert timing["serialized_s"] > 0 and timing["exposed_s"] >= 0
    finally:
        rig.close()
    assert bench.bench_memcpy(1 << 20, 2) > 0 and bench.bench_socket(1 << 20, 2) > 0
