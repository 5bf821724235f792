"""Capability enforcement on a handoff link, by the side whose memory the link touches.

Contract:
  * Destination (its pool is written): one `LinkGuard` per link and transfer. `screen(frame)`
    runs on every received frame before the endpoint sees it. Until admission only the
    transfer's `ManifestFrame` passes, and only if the capability it carries verifies against
    the destination's own reservation (tenant, source worker and epoch, transfer id and
    generation; this worker and epoch; its pool's K/V ABI; the link's direction), the blocks the
    manifest would write and the bytes those writes cover (`on_claims(claims)` then runs: a
    pull link restricts its reads to the source blocks the capability names; then `on_admit`: a
    staging link creates and offers its segment only now). After admission, frames of any other
    transfer are dropped and `landing` (a `GrantedLanding`) refuses to write a chunk of another
    transfer or outside the capability's blocks. A denial aborts the unpublished transfer
    (its blocks go back once no write is in flight) and answers the source with a refused
    `PublishAck` carrying the `capability_*` reason; nothing has been written by then. (A
    served listener turns away a first manifest whose capability is not the issuer's before the
    link claims the transfer, so the guard sees only signed capabilities: workers/handoff_io.py.)
  * Source (its pool is read, or its bytes leave the process): `source_expectation` is what
    `Verifier.verify` is checked against before the link is opened (with a fetch holder's own
    pinned (segment, slot) pairs, which must be exactly the capability's); a denial ends the transfer
    there, before the source's memory is revealed to anyone.
Verification itself is handoff/trust/capability.py; this module only knows the protocol's objects.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from pdserve.handoff.trust.capability import Claims, Expectation, Verifier
from pdserve.handoff.endpoint import DecodeEndpoint, GrantedLanding
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.frames import ChunkFrame, Frame, ManifestFrame
from pdserve.handoff.manifest import HandoffManifest


def written_bytes(manifest: HandoffManifest, slab_bytes: int) -> int:
    """Bytes the manifest's chunks write at the destination: K and V of each chunk's blocks for
    its layer, from the destination's own ABI (never the manifest's declared sizes)."""
    return sum(2 * c.count * slab_bytes for c in manifest.chunks)


def destination_expectation(endpoint: DecodeEndpoint, transfer_id: str, manifest: HandoffManifest,
                            direction: str) -> Expectation:
    """The destination's own view of a transfer: every field from its reservation, its identity
    and its pool; only the blocks and bytes come from the manifest (bounded by the capability)."""
    txn = endpoint.transfers[transfer_id]
    r = txn.request
    abi = endpoint.pool.abi
    return Expectation(r.tenant, r.source_worker, r.source_epoch, endpoint.worker, endpoint.epoch, r.transfer_id,
                       r.generation, abi.abi_hash, direction, tuple(manifest.dst_blocks),
                       written_bytes(manifest, abi.slab_bytes))


def source_expectation(manifest: HandoffManifest, source: str, source_epoch: int, abi_hash: str,
                       direction: str, src_segments: tuple[str, ...] | None = None,
                       src_slots: tuple[tuple[int, int], ...] | None = None) -> Expectation:
    f = manifest.fence
    return Expectation(f.tenant, source, source_epoch, f.destination_worker, f.destination_epoch,
                       manifest.transfer_id, f.generation, abi_hash, direction, tuple(manifest.dst_blocks),
                       manifest.total_bytes, src_segments, src_slots)


def _transfer_id_of(frame: Frame) -> str | None:
    if isinstance(frame, ManifestFrame):
        return frame.manifest.transfer_id
    return getattr(frame, "transfer_id", None)


class GuardedLanding(GrantedLanding):
    """Lands only the admitted transfer's chunks, and only into blocks the capability allows."""

    def __init__(self, endpoint: DecodeEndpoint, lock=None):
        super().__init__(endpoint, lock)
        self.transfer_id: str | None = None  # set on admission
        self.regions: frozenset[int] = frozenset()
        self.denied: HandoffError | None = None

    def __call__(self, frame: ChunkFrame) -> list[int] | None:
        if self.transfer_id is None or frame.transfer_id != self.transfer_id or self.denied is not None:
            return None
        blocks = super().__call__(frame)  # a grant taken here is ended by `recv` whatever follows
        if blocks is not None and not self.regions.issuperset(blocks):
            self.denied = HandoffError(RejectReason.CAPABILITY_REGION, f"{frame.chunk_id} lands outside the capability")
            return None
        return blocks


class LinkGuard:
    def __init__(self, verifier: Verifier, endpoint: DecodeEndpoint, transfer_id: str, direction: str, lock=None,
                 on_admit: Callable[[], None] | None = None, on_claims: Callable[[Claims], None] | None = None):
        self.verifier, self.endpoint = verifier, endpoint
        self.on_admit = on_admit  # e.g. a staging link offers its segment only now
        self.on_claims = on_claims  # e.g. a pull link reads only the source blocks the capability names
        self.transfer_id, self.direction = transfer_id, direction
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.landing = GuardedLanding(endpoint, lock)
        self.refused = False  # a denial ended the transfer on this link

    @property
    def admitted(self) -> bool:
        return self.landing.transfer_id is not None

    def screen(self, frame: Frame) -> list[Frame] | None:
        """None: hand `frame` to the endpoint. A list: send these answers instead (empty: drop)."""
        if _transfer_id_of(frame) != self.transfer_id:
            return []
        if self.landing.denied is not None:
            return self._refuse(self.landing.denied)
        if self.admitted:
            return None
        if not isinstance(frame, ManifestFrame):
            return []  # nothing before the manifest that authorizes the link
        try:
            self._admit(frame)
        except HandoffError as err:
            return self._refuse(err)
        return None

    def _admit(self, frame: ManifestFrame) -> None:
        with self.lock:
            expect = destination_expectation(self.endpoint, self.transfer_id, frame.manifest, self.direction)
        claims = self.verifier.verify(frame.capability, expect)
        self.landing.regions = frozenset(claims.regions)
        if self.on_claims is not None:
            self.on_claims(claims)
        self.landing.transfer_id = self.transfer_id
        if self.on_admit is not None:
            self.on_admit()

    def _refuse(self, err: HandoffError) -> list[Frame]:
        self.refused = True
        with self.lock:
            return [self.endpoint.refuse(self.transfer_id, err.reason)]
