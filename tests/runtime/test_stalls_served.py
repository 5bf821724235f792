"""Real faults in the middle of a K/V transfer on a served 2P1D cluster over TCP (issue 35):
SIGSTOP and kill -9 of the prefill worker with part of its K/V sent, and a client that closes its
HTTP connection meanwhile, followed by a request that needs the aborted request's blocks.

How a transfer is caught with part of its K/V unsent, on any machine: the decode worker is
stopped (SIGSTOP) as soon as the router sends the Prefill (its reservation is granted), so the
prefill worker's send fills the socket buffers and blocks. Request a's K/V (2400 tokens, float32:
150 blocks of 128 KiB) is larger than both buffers together can ever hold (tcp.py asks 4 MiB each,
the kernel doubles that: 16 MiB), so bytes are left unsent; the test reads the connection's
queues in /proc/net/tcp and checks it. Then the prefill worker is stopped or killed and the decode
worker continued: it reads what was sent and waits for the rest. (The sender writes whole chunks
while the buffer has room for them, so the wait is usually at a chunk's boundary: a silent source,
which the decode worker gives up on after the listener's give-up time.)

Every scenario ends with a's tokens or the next request's equal to one engine's, every pool back
at baseline (integrity checked) and the router's leak check. Pools are sized so that a recompute
of a fits beside a's stalled reservation at the decode worker, and the next request of the
disconnect scenario fits only in a's blocks (and not in the stopped prefill worker's pool).
These are durable checks of the served path under the real signals; the same faults caught in
the middle of a chunk's payload, which a real sender rarely leaves, are driven byte by byte in
tests/runtime/test_handoff_faults_served.py and tests/workers/test_handoff_stalls.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import pytest

from pdserve.api.backend import FinishEvent
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.process.supervisor import RestartPolicy
from tests.runtime.conftest import (
    WORKER_THREADS,
    collect,
    config,
    prompt,
    wait_baseline,
)
from tests.runtime.served_http import open_stream, served_app
from tests.runtime.shared_cluster import SharedCluster
from tests.runtime.tcp_links import ESTABLISHED, tcp_links
from tests.runtime.test_supervision import wait_epoch

TOKENS_A = 2400
BLOCKS_A = 150  # a's prompt (and its 8 output tokens at the decode worker)
TOKENS_B = 2600  # 163 prompt blocks (164 with its output): more than any pool has beside a's
BLOCKS = 2 * BLOCKS_A + 2  # a recompute of a fits beside a's stalled reservation
ENGINE = EngineConfig(model="tiny", dtype="float32", num_blocks=BLOCKS)
SOCKET_BUFFERS_MAX = 4 * (4 << 20)  # send + receive buffer, each asked 4 MiB and doubled by the kernel
LEASE_S = 60.0  # past every stop here (a worker stopped longer may reclaim K/V the router renewed meanwhile);
# handoff sockets time out after a third of it, at most 10 s (handoff/limits.py)
TTFT_SLO_S = 10.0  # the router's wait for a stalled K/V (recovery.py: the TTFT target less the time since the
# prefill ended) runs out with the decode worker's own give-up on the silent link, not 20 s after it (the
# default target, 30 s, would only lengthen the stopped-source case; the wait itself is tested either way)
PARAMS_A = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    """2P1D over TCP, serialized transfers (the whole payload is ready when the link opens), a
    heartbeat timeout well past every stop here (no worker is retired for it), a TTFT target
    (the router's wait for a late K/V) as long as the decode worker's wait on a silent link,
    restarts on for the module's last test (kill -9)."""
    cluster = SharedCluster(config(num_prefill=2, engine=ENGINE, transport="tcp", lease_s=LEASE_S,
                                   heartbeat_timeout_s=LEASE_S, layerwise_threshold_tokens=1 << 20, slo_ttft_s=TTFT_SLO_S,
                                   restart=RestartPolicy(first_delay_s=0.2, max_delay_s=1.0)))
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def reference():
    return Engine(EngineConfig(model="tiny", dtype="float32", num_blocks=512, num_threads=WORKER_THREADS))


def tokens_of(reference: Engine, ids, params: SamplingParams) -> list[int]:
    return list(reference.generate([list(ids)], params)[0].output_ids)


async def until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def queued_bytes(port: int) -> int:
    """Bytes on their way to the listener at `port`: sent by its peers and not yet read by it
    (the answers it sends back are not counted: a stopped peer does not read them)."""
    return sum(rx if local == port else tx for (local, _), (state, tx, rx) in tcp_links(port).items()
               if state == ESTABLISHED)


async def until_steady(read, hold_s: float, timeout_s: float, what: str) -> int:
    """`read()` once it is positive and has not changed for `hold_s`."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while True:
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since >= hold_s:
            return now
        assert time.monotonic() < deadline, f"{what}: {now}"
        await asyncio.sleep(0.02)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@dataclass(frozen=True)
class Stall:
    prefill_id: str
    prefill_pid: int
    link: tuple[int, int]  # the decode worker's end of the stalled link: (its handoff port, the peer's port)

    def open_at_decode(self) -> bool:
        return tcp_links(self.link[0]).get(self.link, ("", 0, 0))[0] == ESTABLISHED


async def stall_mid_payload(backend, launcher, reference: Engine, rid: str, fault: signal.Signals) -> Stall:
    """Catch `rid`'s transfer with part of its payload unsent and strike its prefill worker there
    with `fault` (SIGSTOP or SIGKILL); returns once the decode worker has read every byte that
    was sent."""
    await until(lambda: (live := backend.live.get(rid)) is not None and live.transfer_start_s is not None, 120,
                "the router sent the Prefill")
    live = backend.live[rid]
    decode_pid, port = launcher.pid(live.decode_id), backend.registered[live.decode_id].handoff_address[1]
    os.kill(decode_pid, signal.SIGSTOP)  # its listener reads nothing from here: the prefill's send blocks
    try:
        queued = await until_steady(lambda: queued_bytes(port), 1.0, 120, "the payload never filled the buffers")
        kv_bytes = -(-TOKENS_A // ENGINE.block_size) * reference.abi.bytes_per_block
        assert queued <= SOCKET_BUFFERS_MAX < kv_bytes  # the sender is blocked with bytes left to send
        # the router has a's first token and sees a's prompt in the prefill worker's pool (the
        # disconnect scenario's next request does not fit there: it takes the other prefill worker)
        await until(lambda: live.first_token_s is not None and backend.loads[live.prefill_id].free_blocks <= BLOCKS - BLOCKS_A,
                    30, "the prefill worker's report")
        [link] = [ends for ends, (state, _, rx) in tcp_links(port).items() if ends[0] == port and state == ESTABLISHED and rx]
        stall = Stall(live.prefill_id, launcher.pid(live.prefill_id), link)
        os.kill(stall.prefill_pid, fault)
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    await until(lambda: queued_bytes(port) == 0, 60, "the decode worker read what was sent")
    assert not live.published
    return stall


def test_a_prefill_worker_stopped_mid_transfer_leaves_no_hold_on_the_decode_worker(served, reference):
    """While the prefill worker stays stopped, a is recomputed on the decode worker once the
    router's wait for its K/V runs out and decodes exactly, the decode worker gives up on the
    silent link itself and its pool comes back whole. Once the prefill worker resumes, every
    pool is at baseline."""

    async def main(backend, launcher):
        ids_a = prompt(TOKENS_A, 21)
        task = asyncio.create_task(collect(backend, "a", ids_a, PARAMS_A))
        stall = await stall_mid_payload(backend, launcher, reference, "a", signal.SIGSTOP)
        try:
            ids, event = await asyncio.wait_for(task, 120)
            await until(lambda: not stall.open_at_decode(), 60, "the decode worker kept the stalled link open")
            await until(lambda: decode_idle(backend), 30, "the decode worker's pool came back")
            assert stopped(stall.prefill_pid)  # all of it without the prefill worker
        finally:
            os.kill(stall.prefill_pid, signal.SIGCONT)
        assert isinstance(event, FinishEvent) and ids == tokens_of(reference, ids_a, PARAMS_A)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))


def decode_idle(backend) -> bool:
    load = backend.loads["decode-0"]
    return (load.num_running, load.reserved_blocks, load.free_blocks, load.integrity_ok) == (0, 0, BLOCKS, True)


def test_a_client_gone_mid_transfer_then_a_request_on_its_blocks_decodes_exactly(served, reference):
    """a's client closes its HTTP connection while a's K/V is part landed (its prefill worker
    stopped); b needs a's blocks at the decode worker and, once it has them, runs to its end
    before a's prefill worker resumes and sends the rest of a's K/V; c repeats b's prompt and
    reads b's blocks from the decode worker's prefix cache. Both decode exactly: nothing of a's
    lands in blocks that are no longer a's."""

    async def main(backend, launcher):
        async with served_app(backend) as port:
            client = await open_stream(port, prompt(TOKENS_A, 31), PARAMS_A)
            await until(lambda: len(backend.live) == 1, 60, "a submitted")
            rid = next(iter(backend.live))
            stall = await stall_mid_payload(backend, launcher, reference, rid, signal.SIGSTOP)
            try:
                client.close()  # the client hangs up: the server aborts a at both workers
                await until(lambda: rid not in backend.live, 30, "a aborted")
                ids_b, params_b = prompt(TOKENS_B, 32), SamplingParams(max_tokens=24, ignore_eos=True)
                b = asyncio.create_task(collect(backend, "b", ids_b, params_b))
                await asyncio.sleep(3.0)  # b's reservation is granted once no write into a's blocks is under way
                if (live := backend.live.get("b")) is not None and live.transfer_start_s is not None:
                    await asyncio.wait_for(asyncio.shield(b), 120)  # b runs on a's blocks to its end first
            finally:
                os.kill(stall.prefill_pid, signal.SIGCONT)  # a's late bytes land
            tokens_b, event_b = await asyncio.wait_for(b, 120)
            tokens_c, event_c = await collect(backend, "c", ids_b, params_b)
            want = tokens_of(reference, ids_b, params_b)
            assert isinstance(event_b, FinishEvent) and isinstance(event_c, FinishEvent)
            assert tokens_b == want and tokens_c == want
            assert backend.metrics.requests.labels("aborted")._value.get() >= 1
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))


def test_a_prefill_worker_killed_mid_transfer_is_replaced_and_its_request_decodes_exactly(served, reference):
    """kill -9 with bytes unsent: the decode worker reads what came, then the link's end; the
    request is recomputed there and the worker comes back under its next epoch. (Last in the
    module: it changes a worker's epoch.)"""

    async def main(backend, launcher):
        ids_a = prompt(TOKENS_A, 41)
        task = asyncio.create_task(collect(backend, "a", ids_a, PARAMS_A))
        stall = await stall_mid_payload(backend, launcher, reference, "a", signal.SIGKILL)
        ids, event = await asyncio.wait_for(task, 120)
        assert isinstance(event, FinishEvent) and ids == tokens_of(reference, ids_a, PARAMS_A)
        await until(lambda: not stall.open_at_decode(), 60, "the decode worker kept the dead peer's link open")
        await wait_epoch(backend, stall.prefill_id, 2)
        assert launcher.pid(stall.prefill_id) != stall.prefill_pid and launcher.num_restarts == 1
        ids_b, params_b = prompt(40, 42), SamplingParams(max_tokens=6, ignore_eos=True)
        ids, event = await collect(backend, "after", ids_b, params_b)
        assert isinstance(event, FinishEvent) and ids == tokens_of(reference, ids_b, params_b)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()

    served.run(main(served.backend, served.launcher))
