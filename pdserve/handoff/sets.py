"""The handoff's block sets and byte ledgers, as pure functions over block-hash lists.

Contract (prompt universe U, reusable at prefill R_P, visible at decode V_D):
    compute_set  = U \\ R_P   blocks the prefill worker must compute
    transfer_set = U \\ V_D   blocks whose exact state must become visible at the destination
A source-side hit shrinks only the compute set; only a destination-side hit shrinks the
transfer. Logical K/V bytes follow the transfer set; padding, frame headers, checksums and
retries go to the separate `PhysicalTraffic` ledger and never inflate the logical bytes.
Order of the universe is preserved in every returned list.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.engine.kv_abi import KvAbi


def compute_set(universe: list[str], reusable_at_prefill: set[str] | list[str]) -> list[str]:
    reusable = set(reusable_at_prefill)
    return [h for h in universe if h not in reusable]


def transfer_set(universe: list[str], visible_at_decode: set[str] | list[str]) -> list[str]:
    visible = set(visible_at_decode)
    return [h for h in universe if h not in visible]


def logical_transfer_bytes(num_blocks: int, abi: KvAbi) -> int:
    """|X| * block_tokens * L * 2 * H_kv * d_h * bytes."""
    return num_blocks * abi.block_size * abi.bytes_per_token


def logical_token_bytes(num_tokens: int, abi: KvAbi) -> int:
    """Bytes for exactly `num_tokens` token rows (no block padding)."""
    return num_tokens * abi.bytes_per_token


@dataclass(frozen=True)
class PhysicalTraffic:
    """What actually crossed the wire, apart from logical K/V bytes. Immutable; `add` returns a copy."""

    payload_bytes: int = 0
    padding_bytes: int = 0
    header_bytes: int = 0
    checksum_bytes: int = 0
    retry_bytes: int = 0
    num_frames: int = 0
    num_retries: int = 0

    def add(self, **deltas: int) -> "PhysicalTraffic":
        return replace(self, **{k: getattr(self, k) + v for k, v in deltas.items()})

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.padding_bytes + self.header_bytes + self.checksum_bytes + self.retry_bytes


@dataclass
class TrafficCounter:
    """A mutable accumulator around `PhysicalTraffic` for a link's hot path."""

    snapshot: PhysicalTraffic = field(default_factory=PhysicalTraffic)

    def record(self, **deltas: int) -> None:
        self.snapshot = self.snapshot.add(**deltas)
