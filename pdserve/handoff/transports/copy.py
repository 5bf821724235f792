"""Copy transports: the source writes a chunk straight into the destination pool, then sends its frame.

Contract: used when both workers share memory. `inproc_links` connects two pools in one process
(tests); `ShmSenderLink` attaches to the destination pool's POSIX shared-memory segment by name
(same host, other process) and sends frames over any `SocketChannel` (a Unix or TCP socket).
The copy is one memcpy per run of consecutive blocks; the destination verifies the bytes it
finds in its own blocks, so a torn or misplaced copy fails its checksum there.
Limitation: a copy cannot be refused by the destination before it happens; fencing a stale
source relies on the destination never re-reserving an aborted transfer's blocks for a newer
one before the source's epoch is fenced.
"""

from __future__ import annotations

import numpy as np

from pdserve.engine.kv_abi import KvAbi
from pdserve.engine.kv_pool import KvPool
from pdserve.handoff.frames import ChunkFrame, Frame
from pdserve.handoff.kvbytes import copy_chunk, pool_bytes
from pdserve.handoff.transports.base import ChunkPayload, Landing, ReceiverLink, SenderLink
from pdserve.handoff.transports.channels import QueueChannel, SocketChannel


class _CopySender(SenderLink):
    def __init__(self, dst_raw: np.ndarray):
        super().__init__()
        self.dst_raw = dst_raw

    def send_chunk(self, frame: ChunkFrame, payload: ChunkPayload) -> None:
        copy_chunk(payload.src_raw, list(payload.src_blocks), self.dst_raw, list(payload.dst_blocks), payload.layer)
        self.traffic.record(payload_bytes=frame.nbytes, retry_bytes=frame.nbytes if frame.resend else 0)
        self.send(frame)


class InProcSenderLink(_CopySender):
    def __init__(self, dst_raw: np.ndarray, out: QueueChannel, back: QueueChannel):
        super().__init__(dst_raw)
        self.out, self.back = out, back

    def send(self, frame: Frame) -> None:
        self.traffic.record(num_frames=1)
        self.out.put(frame)

    def recv(self, timeout_s: float) -> Frame | None:
        return self.back.get(timeout_s)

    def close(self) -> None:
        self.out.close()


class InProcReceiverLink(ReceiverLink):
    def __init__(self, inbox: QueueChannel, back: QueueChannel):
        super().__init__()
        self.inbox, self.back = inbox, back

    def recv(self, timeout_s: float, landing: Landing) -> Frame | None:
        return self.inbox.get(timeout_s)

    def send(self, frame: Frame) -> None:
        self.back.put(frame)

    def close(self) -> None:
        self.back.close()


def inproc_links(dst_pool: KvPool) -> tuple[InProcSenderLink, InProcReceiverLink]:
    out, back = QueueChannel(), QueueChannel()
    return InProcSenderLink(pool_bytes(dst_pool), out, back), InProcReceiverLink(out, back)


class ShmSenderLink(_CopySender):
    """Attach to the destination's shared-memory pool; frames go over `channel`."""

    def __init__(self, channel: SocketChannel, abi: KvAbi, dst_shm_name: str, dst_num_blocks: int):
        self._pool = KvPool(abi, dst_num_blocks, shm_name=dst_shm_name, create=False)
        super().__init__(pool_bytes(self._pool))
        self.channel = channel

    def send(self, frame: Frame) -> None:
        header = self.channel.send_frame(frame)
        self.traffic.record(header_bytes=header, num_frames=1)

    def recv(self, timeout_s: float) -> Frame | None:
        return self.channel.recv_frame(timeout_s)

    def close(self) -> None:
        self.dst_raw = None
        self._pool.close()
        self.channel.close()


class ShmReceiverLink(ReceiverLink):
    """The destination end: payloads are already in its pool when a frame arrives."""

    def __init__(self, channel: SocketChannel):
        super().__init__()
        self.channel = channel

    def recv(self, timeout_s: float, landing: Landing) -> Frame | None:
        return self.channel.recv_frame(timeout_s)

    def send(self, frame: Frame) -> None:
        self.channel.send_frame(frame)

    def close(self) -> None:
        self.channel.close()
