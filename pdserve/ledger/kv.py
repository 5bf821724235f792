"""K/V byte ledger and the handoff set algebra (spec 0x01A, 0x06).

Contracts:
  * bytes are logical K/V payload only (K and V, every layer); padding, descriptors and
    retries belong to the physical ledger (`physical_transfer_bytes`);
  * the compute set is what the prefill worker lacks, the transfer set is what the decode
    worker lacks; the two are independent, and bytes always follow the transfer set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def kv_bytes_per_layer_token(kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one token's K plus V for a single layer: 2 * H_kv * d_h * b."""
    _require_positive(kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    return 2 * kv_heads * head_dim * dtype_bytes


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one token adds to the cache across all layers: L * 2 * H_kv * d_h * b."""
    _require_positive(layers=layers)
    return layers * kv_bytes_per_layer_token(kv_heads, head_dim, dtype_bytes)


def kv_bytes(tokens: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Logical K/V bytes for `tokens` rows (each row counted once)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return tokens * kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes)


def total_kv_bytes(token_counts: Sequence[int], bytes_per_token: int) -> int:
    """Sum of per-request logical bytes for requests sharing one cache geometry."""
    if any(n < 0 for n in token_counts):
        raise ValueError("token counts must be >= 0")
    return sum(token_counts) * bytes_per_token


def payload_time_s(payload_bytes: int, bandwidth_bytes_per_s: float) -> float:
    """Payload-only transfer time; setup, validation and publication are not included."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("bandwidth must be positive")
    return payload_bytes / bandwidth_bytes_per_s


@dataclass(frozen=True)
class HandoffSets:
    """Block ids (in prompt order) that prefill must compute and that must reach decode."""

    compute_blocks: tuple[str, ...]
    transfer_blocks: tuple[str, ...]


def fork_blocks(prompt_tokens: int, max_tokens: int, n: int, block_size: int, max_model_len: int) -> tuple[int, int, int]:
    """(prompt blocks, growth blocks in all, growth blocks of one sequence) for n sequences decoding
    over one prompt (an n > 1 request): each grows on its own to min(prompt + max_tokens,
    max_model_len), and every sequence but the first copies a partial last prompt block."""
    prompt_blocks = -(-prompt_tokens // block_size)
    final = min(prompt_tokens + max_tokens, max_model_len)
    each = max(0, -(-final // block_size) - prompt_blocks)
    partial = 1 if prompt_tokens % block_size else 0
    return prompt_blocks, n * each + (n - 1) * partial, each


def handoff_sets(
    prompt_blocks: Sequence[str],
    prefill_reusable: Sequence[str],
    decode_visible: Sequence[str],
) -> HandoffSets:
    """C_P = U minus R_P and X = U minus V_D, keeping prompt order.

    Raises ValueError when the prompt repeats a block id or a reuse set names a block
    outside the prompt (state for another prompt can never be exact here).
    """
    universe = list(prompt_blocks)
    if len(set(universe)) != len(universe):
        raise ValueError("prompt block ids must be unique")
    for label, subset in (("prefill_reusable", prefill_reusable), ("decode_visible", decode_visible)):
        foreign = set(subset) - set(universe)
        if foreign:
            raise ValueError(f"{label} names blocks outside the prompt: {sorted(foreign)}")
    reuse, visible = set(prefill_reusable), set(decode_visible)
    return HandoffSets(
        compute_blocks=tuple(b for b in universe if b not in reuse),
        transfer_blocks=tuple(b for b in universe if b not in visible),
    )


def prefix_handoff_counts(prompt_blocks: int, prefill_reuse: int, decode_visible: int) -> tuple[int, int]:
    """(compute, transfer) block counts when reuse is a count of leading prompt blocks."""
    for name, value in (("prefill_reuse", prefill_reuse), ("decode_visible", decode_visible)):
        if not 0 <= value <= prompt_blocks:
            raise ValueError(f"{name} must be within [0, {prompt_blocks}], got {value}")
    return prompt_blocks - prefill_reuse, prompt_blocks - decode_visible


def logical_transfer_bytes(
    transfer_blocks: int, block_tokens: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """M = |X| * B_block * L * 2 * H_kv * d_h * b."""
    _require_positive(block_tokens=block_tokens)
    return kv_bytes(transfer_blocks * block_tokens, layers, kv_heads, head_dim, dtype_bytes)


def physical_transfer_bytes(
    logical_bytes: int, chunk_bytes: int, header_bytes_per_chunk: int = 0, resent_bytes: int = 0
) -> int:
    """Wire bytes: payload padded up to whole chunks, plus per-chunk headers and resends."""
    _require_positive(chunk_bytes=chunk_bytes)
    chunks = -(-logical_bytes // chunk_bytes)
    return chunks * (chunk_bytes + header_bytes_per_chunk) + resent_bytes


@dataclass(frozen=True)
class PhysicalTraffic:
    """What actually crossed a link, apart from logical K/V bytes. Immutable; `add` returns a copy."""

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
