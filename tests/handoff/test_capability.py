"""Transfer capabilities, the pure core (handoff/trust/capability.py, router/process/capabilities.py): every
denial has its reason, nothing but a fully valid token passes, a nonce is spent only by a token
that passed every other check, and the verdicts agree with the ledger's reference rule."""

from __future__ import annotations

import random

import msgspec
import pytest

from pdserve.handoff.trust.capability import (
    EQUALITY_FIELDS,
    PULL,
    PUSH,
    Claims,
    Expectation,
    ReplayCache,
    Verifier,
    new_nonce,
    new_signing_key,
    peek,
    public_key_bytes,
    sign,
)
from pdserve.handoff.errors import CAPABILITY_DENIALS, HandoffError, RejectReason
from pdserve.ledger.release import authorization_error
from pdserve.router.process.capabilities import CapabilityIssuer
from pdserve.workers.messages import TransferPlan

NOW = 1_000_000.0
KEY = new_signing_key()
EXPECT = Expectation("tenant-a", "prefill-0", 3, "decode-0", 7, "req-1/g1", 1, "abi-x", PUSH, (4, 5, 6), 3 * 1024)


def claims(**kw) -> Claims:
    base = dict(key_epoch=1, tenant="tenant-a", source="prefill-0", source_epoch=3, destination="decode-0",
                destination_epoch=7, transfer_id="req-1/g1", generation=1, abi="abi-x", direction=PUSH,
                regions=(4, 5, 6), max_bytes=3 * 1024, expires_at=NOW + 60, nonce=new_nonce())
    base.update(kw)
    return Claims(**base)


def verifier(**kw) -> Verifier:
    return Verifier(public_key_bytes(KEY), 1, max_ttl_s=300.0, clock=lambda: NOW, **kw)


def reason(v: Verifier, token, expect: Expectation = EXPECT) -> RejectReason | None:
    try:
        v.verify(token, expect)
    except HandoffError as err:
        return err.reason
    return None


def test_a_valid_token_verifies_once_and_is_compact():
    c = claims()
    token = sign(KEY, c)
    assert len(token) < 256 and peek(token) == c
    v = verifier()
    assert v.verify(token, EXPECT) == c
    assert reason(v, token) is RejectReason.CAPABILITY_REPLAYED  # single use
    assert "key" not in repr(v).lower().replace("key_epoch", "")


@pytest.mark.parametrize("token, expected", [
    (None, RejectReason.CAPABILITY_MISSING),
    (b"", RejectReason.CAPABILITY_MISSING),
    (b"\x00" * 40, RejectReason.CAPABILITY_MALFORMED),
    (b"\x00" * 64 + b"\xc1junk", RejectReason.CAPABILITY_MALFORMED),
])
def test_absent_or_malformed_tokens_are_denied(token, expected):
    assert reason(verifier(), token) is expected


def test_a_token_signed_by_another_key_is_forged():
    assert reason(verifier(), sign(new_signing_key(), claims())) is RejectReason.CAPABILITY_FORGED


def test_a_tampered_token_is_forged():
    token = bytearray(sign(KEY, claims()))
    token[-20] ^= 1
    assert reason(verifier(), bytes(token)) in (RejectReason.CAPABILITY_FORGED, RejectReason.CAPABILITY_MALFORMED)


def test_expired_and_overlong_tokens_are_denied():
    assert reason(verifier(), sign(KEY, claims(expires_at=NOW))) is RejectReason.CAPABILITY_EXPIRED
    assert reason(verifier(), sign(KEY, claims(expires_at=NOW - 1))) is RejectReason.CAPABILITY_EXPIRED
    assert reason(verifier(), sign(KEY, claims(expires_at=NOW + 301))) is RejectReason.CAPABILITY_EXPIRED


@pytest.mark.parametrize("name", EQUALITY_FIELDS)
def test_every_equality_field_is_checked(name):
    value = getattr(EXPECT, name)
    other = value + 1 if isinstance(value, int) else (PULL if value == PUSH else value + "'")
    assert reason(verifier(), sign(KEY, claims(**{name: other}))) is RejectReason.CAPABILITY_MISMATCH


def test_regions_must_be_a_subset_and_bytes_within_the_bound():
    assert reason(verifier(), sign(KEY, claims(regions=(4, 5)))) is RejectReason.CAPABILITY_REGION
    assert reason(verifier(), sign(KEY, claims(regions=(4, 5, 6, 7)))) is None  # a superset allows
    assert reason(verifier(), sign(KEY, claims(max_bytes=3 * 1024 - 1))) is RejectReason.CAPABILITY_BYTES
    empty = Expectation(**{**EXPECT.__dict__, "nbytes": 0})
    assert reason(verifier(), sign(KEY, claims()), empty) is RejectReason.CAPABILITY_BYTES


def test_a_denied_attempt_does_not_spend_the_nonce():
    token, v = sign(KEY, claims()), verifier()
    wrong = Expectation(**{**EXPECT.__dict__, "transfer_id": "req-2/g1"})
    assert reason(v, token, wrong) is RejectReason.CAPABILITY_MISMATCH
    assert reason(v, token) is None and len(v.replay) == 1


def test_rotation_revokes_every_outstanding_token():
    issuer = CapabilityIssuer(clock=lambda: NOW)
    plan = TransferPlan("req-1/g1", 1, 1, "tenant-a", "decode-0", 7, "res", (9, 4, 5, 6), 1, "tcp", ("127.0.0.1", 1))
    old = issuer.issue(plan, "prefill-0", 3, "abi-x", False, 1024).capability
    v = Verifier(bytes.fromhex(issuer.public_key_hex), issuer.key_epoch, clock=lambda: NOW)
    public, epoch = issuer.rotate()
    v.install(bytes.fromhex(public), epoch)
    assert reason(v, old) is RejectReason.CAPABILITY_REVOKED
    fresh = issuer.issue(plan, "prefill-0", 3, "abi-x", False, 1024).capability
    assert reason(v, fresh) is None
    with pytest.raises(ValueError):
        v.install(bytes.fromhex(public), epoch)  # the key epoch only moves forward


def test_a_capability_of_a_retired_route_epoch_is_refused_by_the_owner():
    route = [1]
    issuer = CapabilityIssuer(clock=lambda: NOW, route_epoch=lambda: route[0])
    plan = TransferPlan("req-1/g1", 1, 1, "tenant-a", "decode-0", 7, "res", (9, 4, 5, 6), 1, "tcp", ("127.0.0.1", 1))
    old = issuer.issue(plan, "prefill-0", 3, "abi-x", False, 1024).capability
    v = Verifier(bytes.fromhex(issuer.public_key_hex), issuer.key_epoch, clock=lambda: NOW)
    route[0] = 2  # a rollback's ADVANCE_ROUTE_EPOCH, on the router and then on the worker
    v.advance_route(2)
    assert peek(old).route_epoch == 1 and reason(v, old) is RejectReason.CAPABILITY_STALE_ROUTE
    fresh = issuer.issue(plan, "prefill-0", 3, "abi-x", False, 1024).capability
    assert peek(fresh).route_epoch == 2 and reason(v, fresh) is None
    v.advance_route(1)  # never moves back
    assert v.route_epoch == 2


def test_the_issuer_binds_the_plan_exactly():
    issuer = CapabilityIssuer(ttl_s=30.0, clock=lambda: NOW)
    plan = TransferPlan("req-1/g1", 1, 1, "tenant-a", "decode-0", 7, "res", (9, 4, 5, 6), 1, "shm", ("127.0.0.1", 1))
    c = peek(issuer.issue(plan, "prefill-0", 3, "abi-x", True, 1024).capability)
    assert (c.tenant, c.source, c.source_epoch, c.destination, c.destination_epoch, c.transfer_id, c.generation) == \
        ("tenant-a", "prefill-0", 3, "decode-0", 7, "req-1/g1", 1)
    assert (c.abi, c.direction, c.regions, c.max_bytes, c.expires_at, len(c.nonce)) == \
        ("abi-x", PULL, (4, 5, 6), 3 * 1024, NOW + 30.0, 16)
    second = peek(issuer.issue(plan, "prefill-0", 3, "abi-x", True, 1024).capability)
    assert second.nonce != c.nonce and issuer.public_key_hex not in repr(issuer)


def test_the_replay_cache_is_bounded_and_forgets_expired_nonces():
    cache = ReplayCache(capacity=2)
    cache.claim(b"a", NOW + 1, NOW)
    cache.claim(b"b", NOW + 5, NOW)
    with pytest.raises(HandoffError) as full:
        cache.claim(b"c", NOW + 5, NOW)
    assert full.value.reason is RejectReason.CAPABILITY_REPLAY_FULL
    cache.claim(b"c", NOW + 5, NOW + 2)  # "a" expired and left
    with pytest.raises(HandoffError) as again:
        cache.claim(b"b", NOW + 5, NOW + 2)
    assert again.value.reason is RejectReason.CAPABILITY_REPLAYED and len(cache) == 2


def test_every_capability_reason_is_a_reject_reason_with_the_prefix():
    assert {r.value for r in CAPABILITY_DENIALS} == {r.value for r in RejectReason if r.value.startswith("capability_")}
    assert len(CAPABILITY_DENIALS) == 12


def _ledger_view(c: Claims, e: Expectation, signed_ok: bool) -> tuple[dict, dict]:
    """The same case in the ledger's reference form (route epoch = both worker epochs)."""
    request = {"tenant": e.tenant, "source": e.source, "destination": e.destination, "transfer_id": e.transfer_id,
               "generation": e.generation, "cache_abi": e.abi, "direction": e.direction, "nonce": c.nonce,
               "regions": list(e.regions), "bytes": e.nbytes}
    capability = {"signature_valid": signed_ok, "issuer": "router", "expires_at_s": c.expires_at, "tenant": c.tenant,
                  "source": c.source, "destination": c.destination, "transfer_id": c.transfer_id,
                  "generation": c.generation, "cache_abi": c.abi, "direction": c.direction, "nonce": c.nonce,
                  "route_epoch": (c.source_epoch, c.destination_epoch), "allowed_regions": list(c.regions),
                  "max_bytes": c.max_bytes}
    return request, capability


def test_verdicts_match_the_ledgers_reference_rule_on_random_cases():
    rng = random.Random(7)
    mutations = [("tenant", "tenant-b"), ("source", "prefill-1"), ("source_epoch", 4), ("destination", "decode-1"),
                 ("destination_epoch", 8), ("transfer_id", "req-1/g2"), ("generation", 2), ("abi", "abi-y"),
                 ("direction", PULL), ("regions", (4, 5)), ("regions", (4, 5, 6, 9)), ("max_bytes", 3000),
                 ("max_bytes", 1 << 20), ("expires_at", NOW - 5), ("expires_at", NOW + 400), ("expires_at", NOW + 1)]
    for _ in range(300):
        picked = dict(rng.sample(mutations, rng.randint(0, 3)))
        c, forged = claims(**picked), rng.random() < 0.1
        token = sign(new_signing_key() if forged else KEY, c)
        ours = reason(verifier(), token)
        request, capability = _ledger_view(c, EXPECT, not forged)
        theirs = authorization_error(request, capability, NOW, (EXPECT.source_epoch, EXPECT.destination_epoch),
                                     ["router"], 300.0)
        assert (ours is None) == (theirs is None), (picked, forged, ours, theirs)


def test_claims_encode_as_a_compact_array():
    c = claims()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(c))[0] == 1  # array_like: fields by position
