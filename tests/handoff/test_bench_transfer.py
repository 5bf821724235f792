"""The bench-transfer command registers cheaply and its runners work on a small geometry, with the
destination in its own process and the published bytes checked against the source."""

from __future__ import annotations

from pdserve.cli import build_parser
from pdserve.commands import bench_transfer as bench
from pdserve.engine.kv.kv_abi import KvAbi


def test_command_registers():
    args = build_parser().parse_args(["bench-transfer", "--json", "--runs", "2"])
    assert args.func is bench.run and args.json and args.runs == 2 and not args.no_capabilities
    assert build_parser().parse_args(["bench-transfer", "--no-capabilities"]).no_capabilities


def test_capability_costs_are_measured_per_signature_and_check():
    sign_us, verify_us = bench.capability_costs(num_blocks=16, n=20)
    assert sign_us > 0 and verify_us > 0


def test_small_handoffs_through_both_transports():
    abi = KvAbi(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
    rig = bench._Rig(abi, 40, blocks_per_chunk=3)
    try:
        for kind in ("shm", "tcp"):
            assert bench.handoff_s(rig, kind, check=True) > 0
            assert bench.handoff_s(rig, kind, check=True) > 0  # the persistent link is reused
        for kind in ("shm", "staging", "tcp"):  # under a capability, checked by the source and the peer
            assert bench.handoff_s(rig, kind, check=True, capabilities=True) > 0
        assert len(rig.verifier.replay) == 3  # one source check (one nonce) per transfer
        assert bench.exposed_s(rig, "tcp", prefill_s=0.02, chunk_tokens=12) >= 0  # 4 chunks: progressive gate
        assert bench.exposed_s(rig, "tcp", prefill_s=0.02, chunk_tokens=40) >= 0  # one chunk: whole layers
        assert bench.bench_socket(rig.peer, 1 << 20) > 0
    finally:
        rig.close()
    assert rig.peer.proc.exitcode == 0
    memcpy = bench._Memcpy(1 << 20)
    assert memcpy.once() > 0 and memcpy.twice() > 0
