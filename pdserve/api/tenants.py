"""Which tenant a request belongs to, so that K/V is reused only within a tenant.

Contract: a client cannot pick another tenant's cache.
  - With `--api-keys FILE` every generation request (and every other keyed route: edge/http_guard.py)
    must carry `Authorization: Bearer KEY` with a key the file names (else 401, the OpenAI error
    body); its tenant is the key's. A request's
    `cache_salt` then salts within that tenant.
  - Without keys, a `cache_salt` (vLLM's field) makes the tenant `salt-<digest>`: requests share
    cached K/V only when they carry the same salt.
  - Otherwise the default tenant.
The tenant travels in `SamplingParams.tenant` to every worker and picks the prefix-cache chain
root there (engine/kv/block_manager.py `root_for`) and in the router's block hashes. Keys are never
logged; they are compared in constant time.
FILE: a JSON object {"KEY": "TENANT", ...}, or lines "KEY TENANT" (# comments allowed).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import replace
from pathlib import Path

from pdserve.api.errors import ApiError
from pdserve.engine.kv.block_manager import DEFAULT_TENANT


def load_api_keys(path: str | Path) -> dict[str, str]:
    text = Path(path).read_text()
    try:
        keys = json.loads(text)
    except json.JSONDecodeError:
        keys = dict(_line(line) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not isinstance(keys, dict) or not keys or not all(isinstance(k, str) and k and isinstance(t, str) and t
                                                          for k, t in keys.items()):
        raise ValueError(f"--api-keys {path}: expected KEY -> TENANT pairs")
    return keys


def _line(line: str) -> tuple[str, str]:
    parts = line.split()
    if len(parts) != 2:
        raise ValueError(f"--api-keys: a line must be 'KEY TENANT', got {len(parts)} fields")
    return parts[0], parts[1]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class TenantResolver:
    def __init__(self, keys: dict[str, str] | None = None):
        self._keys = [(k.encode(), t) for k, t in (keys or {}).items()]

    @property
    def keyed(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> None:
        """Raise 401 unless the header carries a configured key (edge/http_guard.py: before the body is read)."""
        self._key_tenant(authorization)

    def tenant(self, authorization: str | None, cache_salt: str | None) -> str:
        base = self._key_tenant(authorization) if self._keys else None
        if cache_salt is None:
            return base or DEFAULT_TENANT
        return f"{base}/salt-{_digest(cache_salt)}" if base else f"salt-{_digest(cache_salt)}"

    def _key_tenant(self, authorization: str | None) -> str:
        scheme, _, given = (authorization or "").partition(" ")
        found = None
        for key, tenant in self._keys:  # every key compared: the time does not say which one matched
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key):
                found = tenant
        if found is None:
            raise ApiError(401, "a valid API key is required: 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")
        return found

    def apply(self, parsed, authorization: str | None, cache_salt: str | None):
        """`parsed` (api/protocol.py ParsedRequest) with its tenant set."""
        tenant = self.tenant(authorization, cache_salt)
        return replace(parsed, params=replace(parsed.params, tenant=tenant))
