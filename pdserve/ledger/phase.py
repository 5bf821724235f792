"""Phase work vectors and the roofline lower bound (spec 0x02A-0x02B).

A toy transformer block ledger: Q/K/V/O projections plus a three-matrix SwiGLU MLP, one
multiply-add = 2 FLOPs, attention work driven by causal query-key pairs. Norms, embeddings,
sampling and the vocabulary head are deliberately left out. Byte terms are unique state
bytes (a lower bound), not measured kernel traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class BlockGeometry:
    """Shape of the modeled transformer stack; `dtype_bytes` applies to weights and K/V."""

    layers: int
    d_model: int
    d_ff: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"BlockGeometry.{name} must be positive, got {value}")

    @property
    def params_per_layer(self) -> int:
        """d*(Hq*dh) + 2*d*(Hkv*dh) + (Hq*dh)*d + 3*d*d_ff."""
        q_width = self.q_heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        return 2 * self.d_model * q_width + 2 * self.d_model * kv_width + 3 * self.d_model * self.d_ff

    @property
    def weight_bytes(self) -> int:
        return self.layers * self.params_per_layer * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """L * H_kv * d_h * (b_K + b_V)."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


@dataclass(frozen=True)
class PhaseWork:
    """W = (F, B_weights, B_kv_read, B_kv_write, A, N_new) for one service slot."""

    flops: int
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    causal_pairs: int
    new_rows: int

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def prefill_causal_pairs(new_rows: int, visible_before: int) -> int:
    """A_P = N*T0 + N(N+1)/2 query-key pairs per head."""
    if new_rows < 0 or visible_before < 0:
        raise ValueError("rows must be >= 0")
    return new_rows * visible_before + new_rows * (new_rows + 1) // 2


def decode_causal_pairs(visible_lengths: Sequence[int]) -> int:
    """A_D = sum of visible lengths (each already including its current row)."""
    if any(s <= 0 for s in visible_lengths):
        raise ValueError("decode visible lengths must be >= 1 (they include the current row)")
    return sum(visible_lengths)


def linear_flops(geometry: BlockGeometry, new_rows: int) -> int:
    """F_linear(N) = 2 * L * N * P_layer."""
    return 2 * geometry.layers * new_rows * geometry.params_per_layer


def attention_flops(geometry: BlockGeometry, causal_pairs: int) -> int:
    """F_attn(A) = 4 * L * H_q * d_h * A (QK^T and PV, one dot product each)."""
    return 4 * geometry.layers * geometry.q_heads * geometry.head_dim * causal_pairs


def prefill_work(geometry: BlockGeometry, new_rows: int, visible_before: int) -> PhaseWork:
    """Prefill of `new_rows` rows after `visible_before` already-cached rows."""
    pairs = prefill_causal_pairs(new_rows, visible_before)
    per_token = geometry.kv_bytes_per_token
    return PhaseWork(
        flops=linear_flops(geometry, new_rows) + attention_flops(geometry, pairs),
        weight_bytes=geometry.weight_bytes,
        kv_read_bytes=(visible_before + new_rows) * per_token,
        kv_write_bytes=new_rows * per_token,
        causal_pairs=pairs,
        new_rows=new_rows,
    )


def decode_work(geometry: BlockGeometry, visible_lengths: Sequence[int]) -> PhaseWork:
    """One decode iteration: one current row per sequence, ragged visible lengths."""
    pairs = decode_causal_pairs(visible_lengths)
    rows = len(visible_lengths)
    per_token = geometry.kv_bytes_per_token
    return PhaseWork(
        flops=linear_flops(geometry, rows) + attention_flops(geometry, pairs),
        weight_bytes=geometry.weight_bytes,
        kv_read_bytes=pairs * per_token,
        kv_write_bytes=rows * per_token,
        causal_pairs=pairs,
        new_rows=rows,
    )


def mixed_work(parts: Sequence[PhaseWork]) -> PhaseWork:
    """One shared slot running all `parts`: work adds up, weights are read once."""
    if not parts:
        raise ValueError("a mixed slot needs at least one part")
    return PhaseWork(
        flops=sum(p.flops for p in parts),
        weight_bytes=max(p.weight_bytes for p in parts),
        kv_read_bytes=sum(p.kv_read_bytes for p in parts),
        kv_write_bytes=sum(p.kv_write_bytes for p in parts),
        causal_pairs=sum(p.causal_pairs for p in parts),
        new_rows=sum(p.new_rows for p in parts),
    )


def lower_bound_s(work: PhaseWork, flops_per_s: float, bytes_per_s: float) -> float:
    """max(F / C, (B_weights + B_kv_read + B_kv_write) / R)."""
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError("compute and byte rates must be positive")
    return max(work.flops / flops_per_s, work.state_bytes / bytes_per_s)


def bound_side(work: PhaseWork, flops_per_s: float, bytes_per_s: float) -> str:
    """'compute' when F/C sets the bound, else 'bytes' (ties count as compute)."""
    compute_s = work.flops / flops_per_s
    return "compute" if compute_s >= work.state_bytes / bytes_per_s else "bytes"


@dataclass(frozen=True)
class SlotBounds:
    prefill_lb_s: float
    decode_lb_s: float
    mixed_lb_s: float

    @property
    def dilation(self) -> float:
        """Mixed-slot bound over decode-only bound: how much mixing stretches token cadence."""
        return self.mixed_lb_s / self.decode_lb_s


def slot_bounds(
    geometry: BlockGeometry,
    prefill_new: int,
    prefill_visible: int,
    decode_lengths: Sequence[int],
    flops_per_s: float,
    bytes_per_s: float,
) -> SlotBounds:
    """Lower bounds of the prefill-only, decode-only and mixed slots."""
    prefill = prefill_work(geometry, prefill_new, prefill_visible)
    decode = decode_work(geometry, decode_lengths)
    mixed = mixed_work([prefill, decode])
    return SlotBounds(
        prefill_lb_s=lower_bound_s(prefill, flops_per_s, bytes_per_s),
        decode_lb_s=lower_bound_s(decode, flops_per_s, bytes_per_s),
        mixed_lb_s=lower_bound_s(mixed, flops_per_s, bytes_per_s),
    )
