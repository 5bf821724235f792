"""`pdserve bench-transfer`: move K/V through every handoff transport and compare with raw baselines.

The decode side runs in its own spawned process (`transfer_peer`), as in the runtime; the source
keeps one persistent link per transport, "one stream per (source, destination)". Every round
measures the peers and the handoffs back to back, so a noisy machine hits them alike; the
reported figures are medians over `--runs` rounds:
  memcpy_gbps   numpy copy of 64 MiB into a preallocated buffer (this process)
  socket_gbps   raw loopback TCP: 64 MiB sent in 1 MiB pieces, recv_into() a preallocated buffer
                in the peer process
  shm_gbps      64 MiB of K/V handed off on one host as the runtime does (pull: the destination
                copies from the source's shared pool), reserve -> publish
  staging_gbps  the same through the staging fallback (source -> staging window -> pool)
  tcp_gbps      the same through the TCP transport
(each handoff includes the reservation round trip, manifest, credits, checksums on both ends,
the destination's verification, validation and publication; the last round of each transport
also checks the published bytes against the source, outside the timing),
  copy2_gbps    two back-to-back 64 MiB copies through a 16 MiB window: the memcpy-only lower bound
                of a staging transport (source -> staging -> pool), checksums excluded
and `exposed_fraction` for a 2048-token prompt of the `small` geometry (12 layers, 4 K/V heads,
head dim 64, bf16, block 16): prefill is simulated as the engine runs it, `--prefill-s` seconds
split evenly over (prefill chunk x layer) slices, each slice reported to the producer gate at its
end; transfer chunks stream over TCP as the gate covers them. exposed = publish_end -
prefill_end; the fraction divides it by the serialized transfer time of the same prompt (all
layers ready, reserve -> publish). `exposed_fraction_unchunked` is the same with the prompt
prefilled in one chunk (only whole layers stream).
Capabilities (docs/security.md): each round also runs the three big handoffs and the small TCP one
with a transfer capability (`*_cap_gbps`): the router's signature, the source's check before it
sends and the destination's check of the link's manifest before anything lands, all inside the
timing, so `*_gbps` and `*_cap_gbps` of one run compare the same links on the same machine
(`--no-capabilities` skips them). `capability_sign_us` / `capability_verify_us` are the medians of
2000 signatures and checks of one capability for the small prompt (128 blocks);
`capability_us_per_transfer` = one signature + two checks (source and destination).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid

from pdserve.engine.config import EngineConfig

MIB = 1 << 20
WINDOW_BYTES = 16 * MIB


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-transfer", help="benchmark K/V handoff transports against memcpy and sockets")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefill-s", type=float, default=0.25, help="simulated prefill time of the 2048-token prompt")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                        help="chunked-prefill size of the simulated prefill (default: the engine's)")
    parser.add_argument("--fetch", action="store_true",
                        help="also a cross-worker prefix fetch against an in-process handoff of the same 24 MiB "
                             "(commands/bench_fetch.py: fetch_gbps, handoff_inproc_gbps, fetch_ratio)")
    parser.add_argument("--no-capabilities", action="store_true",
                        help="skip the handoffs with transfer capabilities (run by default beside those without)")
    parser.set_defaults(func=run)


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


class _Memcpy:
    """The memcpy peer (one copy) and the staging lower bound (two copies through a window)."""

    def __init__(self, nbytes: int):
        import numpy as np

        self.nbytes = nbytes
        self.src = np.random.randint(0, 255, nbytes, dtype=np.uint8)
        self.dst, self.stage = np.empty_like(self.src), np.empty(min(nbytes, WINDOW_BYTES), dtype=np.uint8)
        self.once(), self.twice()

    def once(self) -> float:
        import numpy as np

        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0

    def twice(self) -> float:
        import numpy as np

        step = self.stage.size
        t0 = time.perf_counter()
        for off in range(0, self.nbytes, step):
            np.copyto(self.stage, self.src[off : off + step])
            np.copyto(self.dst[off : off + step], self.stage)
        return time.perf_counter() - t0


class _Peer:
    """The destination worker: a spawned `transfer_peer` process and this side's persistent links."""

    def __init__(self, abi, num_blocks: int, identity, public_key_hex: str | None = None):
        import multiprocessing

        from pdserve.commands import transfer_peer

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=transfer_peer.serve, args=(child, abi, num_blocks, identity, public_key_hex),
                                daemon=True)
        self.proc.start()
        self.tcp_address, self.unix_path = self.recv()
        self.links: dict = {}
        self.raw = None

    def recv(self, timeout_s: float = 60.0):
        """The peer's next reply; raises if it died or stayed silent (never hangs the bench)."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.05):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"transfer peer gone (exit code {self.proc.exitcode})")
        return self.conn.recv()

    def link(self, kind: str, src_pool=None):
        if kind not in self.links:
            self.conn.send(("accept", kind))
            self.links[kind] = _sender(kind, self.tcp_address, self.unix_path, src_pool)
            assert self.recv() == "ok"
        return self.links[kind]

    def raw_socket(self):
        if self.raw is None:
            from pdserve.handoff.transports.tcp import connect

            self.conn.send(("accept", "raw"))
            self.raw = connect(self.tcp_address)
            assert self.recv() == "ok"
        return self.raw

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        if self.raw is not None:
            self.raw.close()
        self.conn.send(("stop",))
        self.proc.join(10)


def _sender(kind: str, tcp_address, unix_path: str, src_pool=None):
    import socket

    from pdserve.handoff.transports.channels import SocketChannel
    from pdserve.handoff.transports.copy import ShmSenderLink
    from pdserve.handoff.transports.pull import ShmPullSenderLink
    from pdserve.handoff.transports.tcp import TcpSenderLink, connect

    if kind in ("staging", "shm"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(unix_path)
        if kind == "shm":  # the runtime's same-host path: pull from the source's shared pool
            return ShmPullSenderLink(SocketChannel(sock), src_pool.shm_name, src_pool.num_blocks)
        return ShmSenderLink(SocketChannel(sock), WINDOW_BYTES)
    return TcpSenderLink(connect(tcp_address))


def bench_socket(peer: _Peer, nbytes: int) -> float:
    """One raw loopback send of `nbytes` into the peer's preallocated buffer; seconds."""
    sock, payload = peer.raw_socket(), memoryview(bytearray(nbytes))
    peer.conn.send(("sink", nbytes))
    t0 = time.perf_counter()
    for off in range(0, nbytes, MIB):
        sock.sendall(payload[off : off + MIB])
    assert peer.recv() == "done"
    return time.perf_counter() - t0


class _Rig:
    """A source pool (blocks allocated contiguously) and its destination peer process, reused across runs."""

    def __init__(self, abi, num_tokens: int, blocks_per_chunk: int):
        import torch

        from pdserve.engine.kv.kv_abi import CacheIdentity
        from pdserve.engine.kv.kv_pool import KvPool
        from pdserve.handoff.trust.capability import Verifier
        from pdserve.handoff.kvbytes import pool_bytes
        from pdserve.router.process.capabilities import CapabilityIssuer

        self.abi, self.num_tokens, self.blocks_per_chunk = abi, num_tokens, blocks_per_chunk
        self.num_blocks = -(-num_tokens // abi.block_size)
        self.identity = CacheIdentity("bench-model", "bench-tok", abi.abi_hash)
        self.src = KvPool(abi, self.num_blocks, shm_name=f"pdbench-src-{uuid.uuid4().hex[:12]}")
        self.src.tensor.copy_(torch.randn(self.src.tensor.shape).to(self.src.tensor.dtype))
        self.raw = pool_bytes(self.src)
        self.nbytes = self.num_blocks * abi.bytes_per_block
        self.issuer = CapabilityIssuer()  # the router's role; the source and the peer hold its public key
        self.verifier = Verifier(bytes.fromhex(self.issuer.public_key_hex), self.issuer.key_epoch)
        self.peer = _Peer(abi, self.num_blocks, self.identity, self.issuer.public_key_hex)
        self.num_handoffs = 0

    def close(self) -> None:
        self.peer.close()
        self.src.close(unlink=True)


def _authorize(rig: _Rig, kind: str, manifest) -> bytes:
    """A transfer's capability as the runtime makes and checks it outside the link: the router
    signs it, the source verifies it before sending (the destination checks the link's manifest)."""
    from pdserve.handoff.trust.capability import PULL, PUSH
    from pdserve.handoff.trust.guard import source_expectation
    from pdserve.workers.messages import TransferPlan

    f = manifest.fence
    plan = TransferPlan(manifest.transfer_id, f.generation, f.attempt, f.tenant, f.destination_worker, f.destination_epoch,
                        f.reservation_id, manifest.dst_blocks, 0, "shm" if kind != "tcp" else "tcp", ("127.0.0.1", 0))
    token = rig.issuer.issue(plan, f.source_worker, f.source_epoch, rig.abi.abi_hash, kind == "shm",
                             rig.abi.bytes_per_block).capability
    direction = PULL if kind == "shm" else PUSH
    rig.verifier.verify(token, source_expectation(manifest, f.source_worker, f.source_epoch, rig.abi.abi_hash, direction))
    return token


def _handoff_once(rig: _Rig, kind: str, schedule: str, producer=None, check: bool = False,
                  capabilities: bool = False) -> dict:
    """One reserve -> publish handoff; returns timestamps (time.perf_counter) of its milestones."""
    from pdserve.handoff.credits import ByteCredits
    from pdserve.handoff.destination import ReserveRequest
    from pdserve.handoff.driver import DriveConfig, drive_source
    from pdserve.handoff.gate import LayerGate
    from pdserve.handoff.manifest import IdentityFence, PromptSpan, build_manifest
    from pdserve.handoff.source import SourceTransfer
    from pdserve.handoff.states import TxnState
    from pdserve.handoff.trace import NullSink

    link, peer = rig.peer.link(kind, rig.src), rig.peer
    rig.num_handoffs += 1
    tid = f"x{rig.num_handoffs}"
    gate = LayerGate(rig.abi.num_layers, clock=time.perf_counter)
    req = ReserveRequest(tid, "t", "r0", 1, 0, "p0", 1, "dg", rig.num_tokens, rig.num_blocks)
    t0 = time.perf_counter()
    peer.conn.send(("handoff", kind, req, check, capabilities))
    reservation_id, dst_blocks = peer.recv()
    fence = IdentityFence("t", "r0", 1, 0, "p0", 1, "d0", 1, reservation_id)
    manifest = build_manifest(tid, fence, PromptSpan("dg", rig.num_tokens, 0), rig.identity, rig.abi,
                              list(dst_blocks), rig.blocks_per_chunk, schedule)
    src_blocks = list(range(rig.num_blocks))
    src = SourceTransfer(manifest, rig.raw, src_blocks, ByteCredits(WINDOW_BYTES), gate, NullSink())
    token = _authorize(rig, kind, manifest) if capabilities else None
    if producer is None:
        gate.mark_all_ready()
    else:
        threading.Thread(target=producer, args=(gate,)).start()
    drive_source(src, link, DriveConfig(ack_timeout_s=2.0), capability=token)
    t_end = time.perf_counter()
    _, dst_state, digests = peer.recv()
    assert src.state is TxnState.PUBLISHED and dst_state == "PUBLISHED", (src.terminal_reason, dst_state)
    if check:
        _check_exact(rig, src_blocks, digests)
    return {"start": t0, "end": t_end, "prefill_end": max(gate.ready_times().values())}


def _check_exact(rig: _Rig, src_blocks: list[int], digests: list[int]) -> None:
    from pdserve.handoff.kvbytes import chunk_checksum

    expected = [chunk_checksum(rig.raw, layer, src_blocks) for layer in range(rig.abi.num_layers)]
    if digests != expected:
        raise AssertionError("published destination bytes differ from the source")


def handoff_s(rig: _Rig, kind: str, check: bool = False, capabilities: bool = False) -> float:
    m = _handoff_once(rig, kind, "serialized", check=check, capabilities=capabilities)
    return m["end"] - m["start"]


def capability_costs(num_blocks: int = 128, n: int = 2000) -> tuple[float, float]:
    """Median microseconds of one signature and of one check of a capability for `num_blocks`."""
    from pdserve.handoff.trust.capability import PUSH, Expectation, Verifier
    from pdserve.router.process.capabilities import CapabilityIssuer
    from pdserve.workers.messages import TransferPlan

    issuer = CapabilityIssuer()
    verifier = Verifier(bytes.fromhex(issuer.public_key_hex), issuer.key_epoch)
    blocks = tuple(range(7, 7 + num_blocks))
    plan = TransferPlan("req-0/g1", 1, 1, "tenant", "decode-0", 3, "res", blocks, 0, "tcp", ("127.0.0.1", 0))
    expect = Expectation("tenant", "prefill-0", 2, "decode-0", 3, "req-0/g1", 1, "abi", PUSH, blocks, num_blocks * 4096)
    sign_ns, verify_ns = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        token = issuer.issue(plan, "prefill-0", 2, "abi", False, 4096).capability
        t1 = time.perf_counter_ns()
        verifier.verify(token, expect)
        verify_ns.append(time.perf_counter_ns() - t1)
        sign_ns.append(t1 - t0)
    return statistics.median(sign_ns) / 1e3, statistics.median(verify_ns) / 1e3


def exposed_s(rig: _Rig, kind: str, prefill_s: float, chunk_tokens: int) -> float:
    """Prefill simulated as the engine runs it: the prompt in chunks of `chunk_tokens`, each chunk
    passing through every layer in turn (prefill_s split evenly over chunks x layers); after a
    chunk's pass through a layer, that layer's K/V up to the chunk's end are final."""
    layers = rig.abi.num_layers
    ends = list(range(chunk_tokens, rig.num_tokens, chunk_tokens)) + [rig.num_tokens]
    per_slice_s = prefill_s / (len(ends) * layers)

    def producer(gate) -> None:
        for end in ends:
            for layer in range(layers):
                time.sleep(per_slice_s)
                if end == rig.num_tokens:
                    gate.mark_ready(layer, time.perf_counter())
                else:
                    gate.mark_progress(layer, end)

    m = _handoff_once(rig, kind, "layerwise", producer)
    return max(0.0, m["end"] - m["prefill_end"])


def _rounds(big: _Rig, small: _Rig, memcpy: _Memcpy, runs: int, prefill_s: float, chunk_tokens: int,
            capabilities: bool = True) -> dict[str, list[float]]:
    """Interleave every measurement in each round; the last round also checks exactness."""
    for kind in ("shm", "staging", "tcp"):  # warm-up: links, staging and pools paged in
        handoff_s(big, kind, capabilities=capabilities)
    handoff_s(small, "tcp", capabilities=capabilities)
    bench_socket(big.peer, big.nbytes)
    names = ("memcpy", "copy2", "socket", "shm", "staging", "tcp", "small", "exposed", "exposed_unchunked")
    samples: dict[str, list[float]] = {k: [] for k in names + (_CAP_SAMPLES if capabilities else ())}
    for r in range(runs):
        last = r == runs - 1
        samples["memcpy"].append(memcpy.once())
        samples["shm"].append(handoff_s(big, "shm", check=last))
        samples["copy2"].append(memcpy.twice())
        samples["staging"].append(handoff_s(big, "staging", check=last))
        samples["socket"].append(bench_socket(big.peer, big.nbytes))
        samples["tcp"].append(handoff_s(big, "tcp", check=last))
        samples["small"].append(handoff_s(small, "tcp", check=last))
        if capabilities:  # the same handoffs, each under a capability, in the same round
            for kind in ("shm", "staging", "tcp"):
                samples[f"{kind}_cap"].append(handoff_s(big, kind, check=last, capabilities=True))
            samples["small_cap"].append(handoff_s(small, "tcp", check=last, capabilities=True))
        samples["exposed"].append(exposed_s(small, "tcp", prefill_s, chunk_tokens))
        samples["exposed_unchunked"].append(exposed_s(small, "tcp", prefill_s, small.num_tokens))
    return samples


_CAP_SAMPLES = ("shm_cap", "staging_cap", "tcp_cap", "small_cap")


def _capability_figures(s: dict[str, list[float]], big_bytes: int, small_bytes: int) -> dict:
    sign_us, verify_us = capability_costs()
    out = {"capability_sign_us": sign_us, "capability_verify_us": verify_us,
           "capability_us_per_transfer": sign_us + 2 * verify_us}
    if "small_cap" in s:
        out.update({f"{k}_cap_gbps": _gbps(big_bytes, s[f"{k}_cap"]) for k in ("shm", "staging", "tcp")})
        out.update(small_tcp_cap_gbps=_gbps(small_bytes, s["small_cap"]),
                   small_tcp_cap_overhead_us=(statistics.median(s["small_cap"]) - statistics.median(s["small"])) * 1e6)
    return out


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.kv.kv_abi import KvAbi

    big_abi = KvAbi(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")  # 64 KiB/token
    small_abi = KvAbi(num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
    big = _Rig(big_abi, 64 * MIB // big_abi.bytes_per_token, blocks_per_chunk=64)  # 4 MiB chunks: one per layer
    small = _Rig(small_abi, 2048, blocks_per_chunk=32)  # 512 KiB chunks = one 512-token prefill chunk, 4 per layer
    try:
        s = _rounds(big, small, _Memcpy(64 * MIB), args.runs, args.prefill_s, args.prefill_chunk_tokens,
                    capabilities=not args.no_capabilities)
    finally:
        big.close()
        small.close()
    out = {"memcpy_gbps": _gbps(64 * MIB, s["memcpy"]), "copy2_gbps": _gbps(64 * MIB, s["copy2"]),
           "socket_gbps": _gbps(big.nbytes, s["socket"]), "shm_gbps": _gbps(big.nbytes, s["shm"]),
           "staging_gbps": _gbps(big.nbytes, s["staging"]),
           "tcp_gbps": _gbps(big.nbytes, s["tcp"]), "runs": args.runs}
    out.update(shm_ratio=out["shm_gbps"] / out["memcpy_gbps"], tcp_ratio=out["tcp_gbps"] / out["socket_gbps"],
               copy2_ratio=out["copy2_gbps"] / out["memcpy_gbps"], staging_ratio=out["staging_gbps"] / out["memcpy_gbps"])
    serialized_s, exposed = statistics.median(s["small"]), statistics.median(s["exposed"])
    out.update(small_prompt_bytes=small.nbytes, small_tcp_gbps=small.nbytes / serialized_s / 1e9,
               prefill_s=args.prefill_s, prefill_chunk_tokens=args.prefill_chunk_tokens, exposed_s=exposed,
               serialized_transfer_s=serialized_s, exposed_fraction=exposed / serialized_s,
               exposed_fraction_unchunked=statistics.median(s["exposed_unchunked"]) / serialized_s)
    out.update(_capability_figures(s, big.nbytes, small.nbytes))
    out["samples_ms"] = {k: [round(t * 1e3, 2) for t in v] for k, v in s.items()}
    if args.fetch:
        from pdserve.commands.bench_fetch import fetch_vs_handoff

        out.update(fetch_vs_handoff(args.runs))
    _print(out, args.json)
    return 0


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, sort_keys=True))
        return
    for key in sorted(out):
        value = out[key]
        print(f"{key:>24}  {value:.4f}" if isinstance(value, float) else f"{key:>24}  {value}")
