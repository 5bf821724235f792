"""The router as the issuer of transfer capabilities: one signed permission per planned transfer.

Contract: a `CapabilityIssuer` makes its Ed25519 key pair when the router starts and keeps the
private key in this process only; workers get `public_key_hex` in their launch config, so no
worker can mint a capability. `issue(plan, ...)` returns the `TransferPlan` with a capability
bound to its tenant, both workers and epochs, transfer id, generation, K/V ABI digest, direction,
the destination blocks the transfer writes (those not already visible there), their exact byte
count as the bound, an expiry `ttl_s` ahead and a fresh nonce; for a prefix fetch also the
holder's source blocks as the plan names them (`plan.src_slots`, (segment, slot) pairs) and the
segments those index (`src_segments`: the holder's registered device and host-tier segments).
Every capability binds the router's current route epoch (`route_epoch`, read at issue; a
rollback advances it and the owners refuse older ones). `rotate()` revokes every outstanding
capability: a new key under the next key epoch (workers must be given the new public
key with `Verifier.install`). The format and the check live in handoff/trust/capability.py.
"""

from __future__ import annotations

import time
from typing import Callable

import msgspec

from pdserve.handoff.trust.capability import (
    DEFAULT_TTL_S,
    PULL,
    PUSH,
    Claims,
    new_nonce,
    new_signing_key,
    public_key_bytes,
    sign,
)
from pdserve.workers.messages import TransferPlan


class CapabilityIssuer:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time,
                 route_epoch: Callable[[], int] = lambda: 1):
        self.ttl_s, self.clock, self.route_epoch = ttl_s, clock, route_epoch
        self._key = new_signing_key()
        self.key_epoch = 1
        self.num_issued = 0

    def __repr__(self) -> str:
        return f"CapabilityIssuer(key_epoch={self.key_epoch}, issued={self.num_issued})"

    @property
    def public_key_hex(self) -> str:
        return public_key_bytes(self._key).hex()

    def rotate(self) -> tuple[str, int]:
        """Revoke every outstanding capability: a new key pair under the next key epoch."""
        self._key = new_signing_key()
        self.key_epoch += 1
        return self.public_key_hex, self.key_epoch

    def issue(self, plan: TransferPlan, source: str, source_epoch: int, abi: str, pull: bool,
              bytes_per_block: int, src_segments: tuple[str, ...] = ()) -> TransferPlan:
        """`plan` with its capability: `pull` when the destination will copy from the source's
        shared pool, `bytes_per_block` the K/V ABI's bytes of one block (all layers, K and V)."""
        regions = tuple(plan.dest_blocks[plan.num_visible_blocks :])
        claims = Claims(self.key_epoch, plan.tenant, source, source_epoch, plan.dest_worker, plan.dest_epoch,
                        plan.transfer_id, plan.generation, abi, PULL if pull else PUSH, regions,
                        len(regions) * bytes_per_block, self.clock() + self.ttl_s, new_nonce(),
                        src_segments if plan.src_slots else (), plan.src_slots, self.route_epoch())
        self.num_issued += 1
        return msgspec.structs.replace(plan, capability=sign(self._key, claims))
