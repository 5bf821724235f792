"""A served decode worker's handoff listener under a hostile peer (issue 35, bounded listeners).

A frame header declares its length in 4 bytes: a peer that claims 256 MiB must see the
connection closed before the worker allocates it (the bound follows from the K/V ABI and the
pool: handoff/limits.py), and the listener must go on accepting real handoffs afterwards. The
served requests' tokens equal one engine's and every pool ends at baseline.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline

CLAIMED_HEADER_BYTES = 256 << 20


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib << 10


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True when the peer closed (EOF or reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_an_oversized_frame_header_closes_the_link_unallocated_and_the_listener_serves_on():
    async def main():
        async with cluster(config(transport="tcp")) as (backend, launcher):
            dest = backend.registered["decode-0"]
            pid = launcher.pid("decode-0")
            before = _rss_bytes(pid)
            hostile = socket.create_connection(tuple(dest.handoff_address))
            hostile.sendall(b"T" + struct.pack("<I", CLAIMED_HEADER_BYTES) + b"\x00")  # 6 bytes claiming 256 MiB
            t0 = time.monotonic()
            closed = await asyncio.to_thread(_closed_by_peer, hostile, 10.0)
            closed_s = time.monotonic() - t0
            grown = _rss_bytes(pid) - before
            hostile.close()
            assert closed, "the listener kept a connection that declared a 256 MiB header"
            assert grown < 32 << 20, f"the worker grew by {grown >> 20} MiB for a 6-byte message"
            assert closed_s < 5.0

            reference = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
            cases = [(prompt(n, i), SamplingParams(max_tokens=6, ignore_eos=True)) for i, n in enumerate((40, 300))]
            for i, (p, s) in enumerate(cases):  # real handoffs over the same listener afterwards
                ids, event = await collect(backend, f"after-{i}", p, s)
                assert isinstance(event, FinishEvent) and ids == list(reference.generate([list(p)], s)[0].output_ids)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())
