"""The K/V ABI: how every byte of a worker's paged K/V pool is laid out and interpreted.

Contract: two pools may exchange raw K/V bytes only when their `KvAbi.abi_hash` values are
equal. The hash covers geometry (layers, K/V heads, head dim, block size), representation
(dtype, axis order) and partitioning, so a mismatch in any of them is caught before a byte is
read. `CacheIdentity` adds the model identity (weights, tokenizer, adapter, position and mask
policy); it seeds the prefix-cache hash chain and fences handoffs.

The pool tensor has the axis order declared in `AXIS_ORDER`:
    [L, 2, N, B, H_kv, D]  (layer, K-or-V, block, token-in-block, K/V head, head dim)
so one (layer, K-or-V, block) slab is contiguous: B * H_kv * D scalars.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from pdserve.ledger.kv import kv_bytes_per_token

AXIS_ORDER = "layer,kv,block,token,head,dim"

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def stable_hash(payload: object, length: int = 16) -> str:
    """Hex digest of a canonical JSON encoding (sorted keys); stable across processes and runs."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True)
class KvAbi:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    axis_order: str = AXIS_ORDER
    partition: str = "tp1-pp1"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported K/V dtype {self.dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvAbi.{name} must be positive, got {getattr(self, name)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def slab_elems(self) -> int:
        """Scalars in one (layer, K-or-V, block) slab: B * H_kv * D."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def slab_bytes(self) -> int:
        return self.slab_elems * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes for one token across all layers: L * 2 * H_kv * D * b (the ledger's formula)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers."""
        return self.bytes_per_token * self.block_size

    @property
    def abi_hash(self) -> str:
        return stable_hash(asdict(self))


@dataclass(frozen=True)
class CacheIdentity:
    """What must match, beyond the ABI, for cached K/V to be the same causal state."""

    model_hash: str
    tokenizer_hash: str
    abi_hash: str
    adapter: str = "none"
    position_policy: str = "rope"
    mask_policy: str = "causal"

    @property
    def identity_hash(self) -> str:
        return stable_hash(asdict(self))
