"""K/V leases (pure): granted, renewed while the router lives, expired once it stops."""

from __future__ import annotations

import pytest

from pdserve.handoff.leases import LeaseTable


def test_renewed_leases_never_expire_and_unrenewed_ones_do_once():
    t = LeaseTable(ttl_s=3.0)
    t.grant("long-prefill", now=0.0)
    t.grant("orphan", now=0.0)
    for now in (2.0, 4.0, 6.0, 8.0):  # the router renews every 2 s (well inside 3 s), orphan never
        assert t.expired(now) == (["orphan"] if now == 4.0 else [])
        assert t.renew(["long-prefill", "never-granted"], now) == 1
    assert t.held() == ["long-prefill"] and t.num_expired == 1
    t.drop("long-prefill")
    t.drop("long-prefill")  # idempotent
    assert t.expired(100.0) == [] and t.held() == []


def test_expiry_is_exact_at_the_ttl_and_bad_ttl_is_refused():
    t = LeaseTable(ttl_s=1.5)
    t.grant("a", 10.0)
    assert t.expired(11.49) == [] and t.expired(11.5) == ["a"]
    with pytest.raises(ValueError, match="ttl must be > 0"):
        LeaseTable(0)
