"""Pick a transport for a (source, destination) pair from their host identities.

Contract: same process -> "inproc"; same host (equal host id) with a shared-memory destination
pool -> "shm"; anything else -> "tcp". Host identity is explicit data, never guessed from env.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostIdentity:
    host_id: str  # e.g. the machine's boot id; equal ids mean shared /dev/shm
    process_id: int


def pick_transport(src: HostIdentity, dst: HostIdentity, dst_pool_shared: bool) -> str:
    if src == dst:
        return "inproc"
    if src.host_id == dst.host_id and dst_pool_shared:
        return "shm"
    return "tcp"
