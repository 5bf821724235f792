"""Leases on K/V held for a request that is not yet safe: an unpublished destination reservation
or a source copy pinned for a handoff.

Contract (pure; the caller passes the clock): `grant(key, now)` starts a lease of `ttl_s`;
`renew(keys, now)` extends those still held (the router renews every live request's leases on
each worker it uses, well within `ttl_s`); `drop(key)` ends one when the K/V became safe or was
released; `expired(now)` removes and returns the leases nobody renewed in time: their request's
router is gone (request ended without an abort reaching the worker, router restarted), so the
worker reclaims the K/V. A request whose router lives never expires, however long its prefill.
"""

from __future__ import annotations


class LeaseTable:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._until: dict[str, float] = {}
        self.num_expired = 0

    def grant(self, key: str, now: float) -> None:
        self._until[key] = now + self.ttl_s

    def renew(self, keys, now: float) -> int:
        """Extend the held ones among `keys`; returns how many were held."""
        held = [k for k in keys if k in self._until]
        for key in held:
            self._until[key] = now + self.ttl_s
        return len(held)

    def drop(self, key: str) -> None:
        self._until.pop(key, None)

    def expired(self, now: float) -> list[str]:
        gone = sorted(k for k, until in self._until.items() if until <= now)
        for key in gone:
            del self._until[key]
        self.num_expired += len(gone)
        return gone

    def held(self) -> list[str]:
        return sorted(self._until)
