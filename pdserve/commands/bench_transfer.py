"""`pdserve bench-transfer`: move K/V through every handoff transport and compare with raw baselines.

Measures, as medians of `--runs` repetitions:
  memcpy_gbps   numpy copy of 64 MiB into a preallocated buffer
  socket_gbps   raw loopback TCP: a thread sends 64 MiB in 1 MiB pieces, another recv_into()s a
                preallocated buffer
  shm_gbps      64 MiB of K/V handed off through the shared-memory transport, reserve -> publish
  tcp_gbps      the same through the TCP transport
(each handoff includes manifest, credits, checksums on both ends, validation and publication),
and `exposed_fraction` for a 2048-token prompt of the `small` geometry (12 layers, 4 K/V heads,
head dim 64, bf16, block 16): prefill is simulated as `--prefill-s` seconds split evenly across
the 12 layers, each layer marked ready at the end of its slice; chunks stream layer-wise over TCP.
exposed = publish_end - prefill_end; the fraction divides it by the serialized transfer time of
the same prompt (all layers ready, reserve -> publish).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

MIB = 1 << 20


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-transfer", help="benchmark K/V handoff transports against memcpy and sockets")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefill-s", type=float, default=0.25, help="simulated prefill time of the 2048-token prompt")
    parser.set_defaults(func=run)


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def bench_memcpy(nbytes: int, runs: int) -> float:
    import numpy as np

    src, dst = np.random.randint(0, 255, nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return _median_gbps(nbytes, times)


def bench_socket(nbytes: int, runs: int) -> float:
    from pdserve.handoff.transports.tcp import connect, listen_local

    server = listen_local()
    client = connect(server.getsockname())
    conn, _ = server.accept()
    payload, sink = bytearray(nbytes), bytearray(nbytes)
    times = []
    for _ in range(runs + 1):
        done = threading.Event()
        threading.Thread(target=_recv_all, args=(conn, memoryview(sink), done)).start()
        t0 = time.perf_counter()
        view = memoryview(payload)
        for off in range(0, nbytes, MIB):
            client.sendall(view[off : off + MIB])
        done.wait()
        times.append(time.perf_counter() - t0)
    for s in (client, conn, server):
        s.close()
    return _median_gbps(nbytes, times[1:])


def _recv_all(sock, view: memoryview, done: threading.Event) -> None:
    while len(view):
        view = view[sock.recv_into(view) :]
    done.set()


class _Rig:
    """A source pool and a shared-memory destination pool of one geometry, reused across runs."""

    def __init__(self, abi, num_tokens: int, blocks_per_chunk: int):
        import uuid

        import torch

        from pdserve.engine.kv_abi import CacheIdentity
        from pdserve.engine.kv_pool import KvPool

        self.abi, self.num_tokens, self.blocks_per_chunk = abi, num_tokens, blocks_per_chunk
        self.num_blocks = -(-num_tokens // abi.block_size)
        self.identity = CacheIdentity("bench-model", "bench-tok", abi.abi_hash)
        self.src = KvPool(abi, self.num_blocks)
        self.src.tensor.copy_(torch.randn(self.src.tensor.shape).to(self.src.tensor.dtype))
        self.dst = KvPool(abi, self.num_blocks, shm_name=f"pdbench-{uuid.uuid4().hex[:8]}")
        self.nbytes = self.num_blocks * abi.bytes_per_block

    def close(self) -> None:
        self.src.close()
        self.dst.close(unlink=True)


def _handoff_once(rig: _Rig, kind: str, schedule: str, producer=None) -> dict:
    """One reserve -> publish handoff; returns timestamps (time.perf_counter) of its milestones."""
    from pdserve.handoff.credits import ByteCredits
    from pdserve.handoff.destination import ReserveRequest
    from pdserve.handoff.driver import DriveConfig, drive_source, serve_destination
    from pdserve.handoff.endpoint import DecodeEndpoint
    from pdserve.handoff.kvbytes import pool_bytes
    from pdserve.handoff.manifest import IdentityFence, PromptSpan, build_manifest
    from pdserve.handoff.reservations import PooledDestinationBlocks
    from pdserve.handoff.source import LayerGate, SourceTransfer
    from pdserve.handoff.states import TxnState
    from pdserve.handoff.trace import TraceSink

    trace = TraceSink(clock=time.perf_counter)
    endpoint = DecodeEndpoint("d0", 1, rig.dst, PooledDestinationBlocks(rig.num_blocks), rig.identity, trace=trace)
    sender, receiver = _links(rig, endpoint, kind)
    gate = LayerGate(rig.abi.num_layers, clock=time.perf_counter)
    t0 = time.perf_counter()
    req = ReserveRequest("x0", "t", "r0", 1, 0, "p0", 1, "dg", rig.num_tokens, rig.num_blocks)
    res = endpoint.reserve(req)
    fence = IdentityFence("t", "r0", 1, 0, "p0", 1, "d0", 1, res.reservation_id)
    manifest = build_manifest("x0", fence, PromptSpan("dg", rig.num_tokens, 0), rig.identity, rig.abi,
                              list(res.prompt_blocks), rig.blocks_per_chunk, schedule)
    src = SourceTransfer(manifest, pool_bytes(rig.src), list(range(rig.num_blocks)), ByteCredits(16 * MIB), gate, trace)
    done = lambda: src.state in (TxnState.PUBLISHED, TxnState.ABORTED)  # noqa: E731
    server = threading.Thread(target=serve_destination, args=(endpoint, receiver, "x0"), kwargs={"until": done})
    server.start()
    if producer is None:
        gate.mark_all_ready()
    else:
        threading.Thread(target=producer, args=(gate,)).start()
    drive_source(src, sender, DriveConfig(ack_timeout_s=2.0))
    t_end = time.perf_counter()
    server.join()
    sender.close()
    receiver.close()
    assert src.state is TxnState.PUBLISHED, src.terminal_reason
    endpoint.retire("r0")
    return {"start": t0, "end": t_end, "prefill_end": max(gate.ready_times().values())}


def _links(rig: _Rig, endpoint, kind: str):
    import socket

    from pdserve.handoff.transports.channels import SocketChannel
    from pdserve.handoff.transports.copy import ShmReceiverLink, ShmSenderLink
    from pdserve.handoff.transports.tcp import TcpReceiverLink, TcpSenderLink, connect, listen_local

    if kind == "shm":
        a, b = socket.socketpair()
        return ShmSenderLink(SocketChannel(a), rig.abi, rig.dst.shm_name, rig.num_blocks), ShmReceiverLink(SocketChannel(b))
    server = listen_local()
    client = connect(server.getsockname())
    conn, _ = server.accept()
    server.close()
    return TcpSenderLink(client), TcpReceiverLink(conn, endpoint.raw)


def bench_handoff(rig: _Rig, kind: str, runs: int) -> float:
    _handoff_once(rig, kind, "serialized")  # warm-up: page in the pools
    times = [(lambda m: m["end"] - m["start"])(_handoff_once(rig, kind, "serialized")) for _ in range(runs)]
    return _median_gbps(rig.nbytes, times)


def bench_exposed(rig: _Rig, kind: str, prefill_s: float, runs: int) -> dict:
    per_layer_s = prefill_s / rig.abi.num_layers

    def producer(gate) -> None:
        for layer in range(rig.abi.num_layers):
            time.sleep(per_layer_s)
            gate.mark_ready(layer, time.perf_counter())

    serialized = [(lambda m: m["end"] - m["start"])(_handoff_once(rig, kind, "serialized")) for _ in range(runs)]
    exposed = [(lambda m: max(0.0, m["end"] - m["prefill_end"]))(_handoff_once(rig, kind, "layerwise", producer))
               for _ in range(runs)]
    return {"serialized_s": statistics.median(serialized), "exposed_s": statistics.median(exposed)}


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.kv_abi import KvAbi

    # Note: source and destination run as threads of this one process and share its GIL;
    # real prefill and decode workers are separate processes.
    big_abi = KvAbi(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")  # 64 KiB/token
    small_abi = KvAbi(num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
    big = _Rig(big_abi, 64 * MIB // big_abi.bytes_per_token, blocks_per_chunk=16)  # 1 MiB chunks
    small = _Rig(small_abi, 2048, blocks_per_chunk=64)  # 1 MiB chunks
    try:
        out = {"memcpy_gbps": bench_memcpy(64 * MIB, args.runs), "socket_gbps": bench_socket(64 * MIB, args.runs),
               "shm_gbps": bench_handoff(big, "shm", args.runs), "tcp_gbps": bench_handoff(big, "tcp", args.runs)}
        out.update(shm_ratio=out["shm_gbps"] / out["memcpy_gbps"], tcp_ratio=out["tcp_gbps"] / out["socket_gbps"])
        timing = bench_exposed(small, "tcp", args.prefill_s, args.runs)
        out.update(small_prompt_bytes=small.nbytes, small_tcp_gbps=small.nbytes / timing["serialized_s"] / 1e9,
                   prefill_s=args.prefill_s, exposed_s=timing["exposed_s"], serialized_transfer_s=timing["serialized_s"],
                   exposed_fraction=timing["exposed_s"] / timing["serialized_s"])
    finally:
        big.close()
        small.close()
    _print(out, args.json)
    return 0


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, sort_keys=True))
        return
    for key in sorted(out):
        value = out[key]
        print(f"{key:>24}  {value:.4f}" if isinstance(value, float) else f"{key:>24}  {value}")
