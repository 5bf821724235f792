"""Transfer capabilities: the router's signed permission for one K/V transfer, and its check.

Contract:
  * `Claims` is what one capability allows: the tenant, the source and destination workers and
    their epochs (the identity fence's route), the transfer id and generation, the K/V ABI digest,
    the direction ("push": the source sends the bytes, over TCP or into the destination's staging
    area; "pull": the destination copies them out of the source's shared pool), the destination
    blocks it may write (`regions`), a byte bound, an expiry (Unix seconds), a single-use
    nonce and, for a prefix fetch, the source blocks it may read: `src_slots`, (segment, slot)
    pairs in transfer order, segment i being the shared-memory segment `src_segments[i]` (the
    holder's device pool, then its host tier; advertised at registration), and the route epoch
    it was issued under (a rollback advances it). Empty `src_slots`: the source's
    blocks are not bound here (a prefill -> decode handoff; the source grants them in-band). It is signed with Ed25519 by the router (`sign`); a token is `signature || claims`
    (64 bytes, then msgpack as an array), a few hundred bytes.
  * `Verifier` holds only the issuer's public key and key epoch. `verify(token, expect)` returns
    the claims or raises `HandoffError` with a `capability_*` reason, in this order: present and
    well formed, signature by the current key (an older key epoch reads `capability_revoked`),
    issued under the current route epoch or a later one (older: `capability_stale_route`),
    unexpired with a lifetime within `max_ttl_s`, every equality field equal to `expect`,
    `expect.regions` a subset of the allowed regions, 0 < `expect.nbytes` <= the bound, the
    source blocks (when the checker knows them: the holder, from its own pins) exactly the
    capability's (`capability_source`), and last the nonce unused (`ReplayCache`). A reader that
    learns the source blocks only from frames (the pull destination) enforces `src_slots` per
    read instead (transports/pull.py). The caller runs it before any memory is touched.
  * Revocation: `Verifier.install(public_key, key_epoch)` moves to a new key (a bumped epoch);
    every capability signed under an older key is refused from then on. `advance_route(epoch)`
    retires every route epoch below `epoch` (the rollback's ADVANCE_ROUTE_EPOCH). Keys are never logged
    or printed: no repr here shows one.
Pure apart from the clock (injectable) and the replay cache's lock; the router's side, which
owns the private key, is router/process/capabilities.py.
"""

from __future__ import annotations

import hashlib
import heapq
import secrets
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pdserve.handoff.errors import HandoffError, RejectReason

SIGNATURE_BYTES = 64
NONCE_BYTES = 16
DEFAULT_TTL_S = 300.0  # a transfer may start only after its prefill: queueing counts against it
MAX_TTL_S = 600.0
PUSH, PULL = "push", "pull"


class Claims(msgspec.Struct, frozen=True, array_like=True):
    key_epoch: int
    tenant: str
    source: str
    source_epoch: int
    destination: str
    destination_epoch: int
    transfer_id: str
    generation: int
    abi: str
    direction: str  # PUSH | PULL
    regions: tuple[int, ...]  # destination blocks the transfer may write
    max_bytes: int
    expires_at: float  # Unix seconds (time.time), comparable across hosts
    nonce: bytes
    src_segments: tuple[str, ...] = ()  # shared-memory segments the source blocks live in
    src_slots: tuple[tuple[int, int], ...] = ()  # (segment index, slot) of each source block; () unbound
    route_epoch: int = 1  # the router's route epoch at issue; the owner refuses one a rollback retired


@dataclass(frozen=True)
class Expectation:
    """What the checking side knows independently of the token: its reservation or plan."""

    tenant: str
    source: str
    source_epoch: int
    destination: str
    destination_epoch: int
    transfer_id: str
    generation: int
    abi: str
    direction: str
    regions: tuple[int, ...]  # blocks this use touches
    nbytes: int  # bytes this use moves
    src_segments: tuple[str, ...] | None = None  # None: not known here (the reader checks each read)
    src_slots: tuple[tuple[int, int], ...] | None = None


EQUALITY_FIELDS = tuple(f.name for f in fields(Expectation)
                        if f.name not in ("regions", "nbytes", "src_segments", "src_slots"))
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Claims)


def new_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(public_key: bytes) -> str:
    """A short fingerprint of a public key (for matching, never the key itself)."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def sign(key: Ed25519PrivateKey, claims: Claims) -> bytes:
    body = _encoder.encode(claims)
    return key.sign(body) + body


def peek(token: bytes) -> Claims | None:
    """The claims of a token without checking them (diagnostics and tests only)."""
    try:
        return _decoder.decode(token[SIGNATURE_BYTES:])
    except (msgspec.DecodeError, ValueError, TypeError):
        return None


def _deny(reason: RejectReason, detail: str = "") -> HandoffError:
    return HandoffError(reason, detail)


class ReplayCache:
    """Nonces seen and not yet expired. Bounded: when `capacity` unexpired nonces are held a new
    one is refused (never evicted early: that would let its token be replayed)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._expiry: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def claim(self, nonce: bytes, expires_at: float, now: float) -> None:
        """Record `nonce` as used until `expires_at`; raises if it was used or the cache is full."""
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, old = heapq.heappop(self._heap)
                self._expiry.pop(old, None)
            if nonce in self._expiry:
                raise _deny(RejectReason.CAPABILITY_REPLAYED, "nonce already used")
            if len(self._expiry) >= self.capacity:
                raise _deny(RejectReason.CAPABILITY_REPLAY_FULL, f"{self.capacity} unexpired nonces held")
            self._expiry[nonce] = expires_at
            heapq.heappush(self._heap, (expires_at, nonce))


def check_claims(claims: Claims, expect: Expectation, now: float, max_ttl_s: float) -> None:
    """Every check that needs no key or cache, in order; raises the first denial."""
    remaining = claims.expires_at - now
    if remaining <= 0:
        raise _deny(RejectReason.CAPABILITY_EXPIRED, f"expired {-remaining:.3f} s ago")
    if remaining > max_ttl_s:
        raise _deny(RejectReason.CAPABILITY_EXPIRED, f"lifetime {remaining:.0f} s exceeds {max_ttl_s:.0f} s")
    for name in EQUALITY_FIELDS:
        if getattr(claims, name) != getattr(expect, name):
            raise _deny(RejectReason.CAPABILITY_MISMATCH,
                        f"{name}: capability {getattr(claims, name)!r}, expected {getattr(expect, name)!r}")
    outside = set(expect.regions) - set(claims.regions)
    if outside:
        raise _deny(RejectReason.CAPABILITY_REGION, f"blocks {sorted(outside)[:8]} outside the capability")
    if not 0 < expect.nbytes <= claims.max_bytes:
        raise _deny(RejectReason.CAPABILITY_BYTES, f"{expect.nbytes} B outside (0, {claims.max_bytes}]")
    if expect.src_slots is not None and (tuple(claims.src_segments), tuple(map(tuple, claims.src_slots))) \
            != (tuple(expect.src_segments or ()), tuple(expect.src_slots)):
        raise _deny(RejectReason.CAPABILITY_SOURCE,
                    f"source {list(expect.src_slots)[:8]} is not the capability's {list(claims.src_slots)[:8]}")
    if len(claims.nonce) != NONCE_BYTES:
        raise _deny(RejectReason.CAPABILITY_MALFORMED, "nonce size")


class Verifier:
    """A worker's checker: the issuer's public key (never a private one) and a replay cache."""

    def __init__(self, public_key: bytes, key_epoch: int = 1, max_ttl_s: float = MAX_TTL_S,
                 replay: ReplayCache | None = None, clock: Callable[[], float] = time.time):
        self.max_ttl_s, self.clock = max_ttl_s, clock
        self.replay = replay if replay is not None else ReplayCache()
        self._key: Ed25519PublicKey | None = None
        self.key_epoch = 0
        self.route_epoch = 1  # capabilities of an older route epoch are refused
        self.install(public_key, key_epoch)

    def __repr__(self) -> str:
        return f"Verifier(key_epoch={self.key_epoch})"

    def install(self, public_key: bytes, key_epoch: int) -> None:
        """Trust a new issuer key; capabilities of older key epochs are refused from now on."""
        if key_epoch < self.key_epoch or (key_epoch == self.key_epoch and self._key is not None):
            raise ValueError(f"key epoch {key_epoch} does not advance {self.key_epoch}")
        self._key = Ed25519PublicKey.from_public_bytes(public_key)
        self.key_epoch = key_epoch

    def advance_route(self, route_epoch: int) -> None:
        """The router retired every route epoch below `route_epoch` (never moves back)."""
        self.route_epoch = max(self.route_epoch, route_epoch)

    def unauthenticated(self, token: bytes | None) -> RejectReason | None:
        """Why `token` is not shown to be signed by the installed issuer key (missing, malformed,
        forged; revoked when its unsigned claims name an older key epoch, which a forger may write
        too), or None: only the signature, no claim is checked and no nonce is spent (`verify`)."""
        if not token:
            return RejectReason.CAPABILITY_MISSING
        claims = peek(token) if len(token) > SIGNATURE_BYTES else None
        if claims is None:
            return RejectReason.CAPABILITY_MALFORMED
        try:
            self._key.verify(token[:SIGNATURE_BYTES], token[SIGNATURE_BYTES:])
        except InvalidSignature:
            return RejectReason.CAPABILITY_REVOKED if claims.key_epoch < self.key_epoch else RejectReason.CAPABILITY_FORGED
        return None

    def verify(self, token: bytes | None, expect: Expectation) -> Claims:
        if not token:
            raise _deny(RejectReason.CAPABILITY_MISSING, expect.transfer_id)
        claims = peek(token) if len(token) > SIGNATURE_BYTES else None
        if claims is None:
            raise _deny(RejectReason.CAPABILITY_MALFORMED, f"{len(token)} B token")
        try:
            self._key.verify(token[:SIGNATURE_BYTES], token[SIGNATURE_BYTES:])
        except InvalidSignature:
            if claims.key_epoch < self.key_epoch:
                raise _deny(RejectReason.CAPABILITY_REVOKED, f"key epoch {claims.key_epoch} < {self.key_epoch}") from None
            raise _deny(RejectReason.CAPABILITY_FORGED, "signature is not the issuer's") from None
        if claims.key_epoch != self.key_epoch:
            raise _deny(RejectReason.CAPABILITY_REVOKED, f"key epoch {claims.key_epoch} != {self.key_epoch}")
        if claims.route_epoch < self.route_epoch:
            raise _deny(RejectReason.CAPABILITY_STALE_ROUTE, f"route epoch {claims.route_epoch} < {self.route_epoch}")
        now = self.clock()
        check_claims(claims, expect, now, self.max_ttl_s)
        self.replay.claim(claims.nonce, claims.expires_at, now)
        return claims


def verifier_from_hex(public_key_hex: str | None, key_epoch: int = 1) -> Verifier | None:
    """A worker's verifier from its launch config (None: capabilities are off for this worker)."""
    return Verifier(bytes.fromhex(public_key_hex), key_epoch) if public_key_hex else None
