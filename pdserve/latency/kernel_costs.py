"""Measured kernel costs for a hardware profile: GEMM and attention kernels, all-reduces, elementwise.

Contract: both are pure functions of a kernel's shape, built from a profile's optional `gemm`
and `allreduce_us` blocks (`hardware.py`); a profile without them keeps the plain roofline.

- `GemmCurve.seconds(m, n, k, dtype_bytes)`: one GEMM of an m x k activation by a k x n weight,
  max(F / (C_peak * e(F)), W / (R_peak * r) + t_floor) with F = 2mnk and W the bytes it moves
  (weights, input, output). The compute efficiency ramps with the kernel's size,
  e(F) = e_max / (1 + (F_half / F) ** gamma): small GEMMs fill fewer of the GPU's SMs and spend
  more of their time in prologue and tail. t_floor is the fixed time of a memory-bound kernel
  (launch, ramp-up, drain), which a tensor-parallel shard does not divide.
- `AttentionCurves`: the same curve form fitted separately to measured context (prefill) and
  generation (decode) flash-attention kernels of one layer; the kernel floor (10-20 us) is what
  the flat efficiencies missed on a short prompt or a small decode batch.
- `AllReduceTable.seconds(nbytes, tp)`: one all-reduce of `nbytes` over `tp` GPUs in one node,
  interpolated log-log between measured (bytes, seconds) points; below the smallest point its
  latency, past the largest the last segment's bandwidth. The latency term (10-22 us on an A100
  at tp 2-8) and the protocol switches between message sizes are what an alpha-beta line
  through the datasheet bandwidth misses.

- `ElementwiseCost.seconds(rows, d_model, dtype_bytes)`: one layer's memory-bound elementwise
  kernels (two norms, two residual adds, the activation, the K/V cache write), each reading and
  writing the full rows x d_model activation plus a fixed floor. Under Megatron-style TP every
  rank runs them whole (the norms and residuals are replicated, which is what sequence
  parallelism later split), so they cost the same at every TP degree.

`layer_gemms(geometry, tp)` names the per-rank (n, k) of the four GEMM kernels of one layer
under Megatron-style TP: fused QKV and the MLP's up projection split their outputs, the
attention output and the down projection their inputs.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

from pdserve.ledger.phase import BlockGeometry


@dataclass(frozen=True)
class GemmCurve:
    """One GEMM kernel's time from a fit to measured GEMMs of one GPU type."""

    peak_flops_per_s: float
    peak_bytes_per_s: float
    compute_efficiency_max: float
    compute_half_flops: float
    compute_ramp_exponent: float
    memory_efficiency: float
    kernel_floor_s: float
    memory_half_bytes: float = 0.0  # > 0: the bandwidth ramps with the bytes moved, like compute
    memory_ramp_exponent: float = 1.0

    def seconds(self, m: int, n: int, k: int, dtype_bytes: int) -> float:
        if m <= 0:
            return 0.0
        return self.kernel_s(2.0 * m * n * k, dtype_bytes * (n * k + m * k + m * n))

    def kernel_s(self, flops: float, nbytes: float) -> float:
        """Any kernel of `flops` and `nbytes` on this curve (the attention fits use it directly)."""
        memory = self._memory_s(nbytes) + self.kernel_floor_s
        if flops <= 0:
            return memory
        ramp = 1.0 + (self.compute_half_flops / flops) ** self.compute_ramp_exponent
        compute = flops * ramp / (self.peak_flops_per_s * self.compute_efficiency_max)
        return compute if compute > memory else memory

    def _memory_s(self, nbytes: float) -> float:
        memory = nbytes / (self.peak_bytes_per_s * self.memory_efficiency)
        if self.memory_half_bytes > 0 and nbytes > 0:
            memory *= 1.0 + (self.memory_half_bytes / nbytes) ** self.memory_ramp_exponent
        return memory


@dataclass(frozen=True)
class AttentionCurves:
    """One layer's attention kernels, fitted like a GEMM (`GemmCurve.kernel_s`) to measured
    flash-attention latencies: `context` for a prefill chunk's causal kernel (F = 4 * pairs *
    heads * d_head, W = the K/V it writes and reads), `generation` for the decode rows' kernel
    (W = the K/V they read; its bandwidth ramps with W, e(W) = r / (1 + (W_half / W) ** g), as a
    small batch's few K/V blocks cannot keep every SM reading). Each rank runs its heads' share
    of every layer's kernel."""

    context: GemmCurve
    generation: GemmCurve


@dataclass(frozen=True)
class ElementwiseCost:
    """A layer's elementwise kernels: `kernels` of them, each a full activation read and write."""

    kernels: int
    floor_s: float
    bytes_per_s: float

    def seconds(self, rows: int, d_model: int, dtype_bytes: int) -> float:
        if rows <= 0:
            return 0.0
        return self.kernels * (self.floor_s + 2 * rows * d_model * dtype_bytes / self.bytes_per_s)


@dataclass(frozen=True)
class AllReduceTable:
    """Measured all-reduce latency per TP degree: tp -> ((bytes, seconds), ...) by size."""

    points: tuple[tuple[int, tuple[tuple[float, float], ...]], ...]

    def __post_init__(self) -> None:
        for tp, pts in self.points:
            if len(pts) < 2 or any(b1 <= b0 for (b0, _), (b1, _) in zip(pts, pts[1:])) or min(s for _, s in pts) <= 0:
                raise ValueError(f"all-reduce points for tp {tp}: at least 2, sizes increasing, times positive")

    def seconds(self, nbytes: float, tp: int) -> float:
        if tp <= 1 or nbytes <= 0:
            return 0.0
        pts = self._for(tp)
        sizes = [b for b, _ in pts]
        if nbytes <= sizes[0]:
            return pts[0][1]
        if nbytes >= sizes[-1]:
            (b0, s0), (b1, s1) = pts[-2], pts[-1]
            return s1 + (nbytes - b1) * (s1 - s0) / (b1 - b0)
        i = bisect_left(sizes, nbytes)
        (b0, s0), (b1, s1) = pts[i - 1], pts[i]
        w = math.log(nbytes / b0) / math.log(b1 / b0)
        return s0 * (s1 / s0) ** w

    def _for(self, tp: int) -> tuple[tuple[float, float], ...]:
        """The measured degree, else the next larger one (a ring's latency grows with tp)."""
        known = sorted(t for t, _ in self.points)
        pick = next((t for t in known if t >= tp), known[-1])
        return dict(self.points)[pick]


def gemm_curve_from_dict(d: dict, peak_flops_per_s: float, peak_bytes_per_s: float) -> GemmCurve:
    """The profile's `gemm` block (GFLOP and microseconds, as the fit script prints them)."""
    return GemmCurve(
        memory_half_bytes=float(d.get("memory_half_mb", 0.0)) * 1e6,
        memory_ramp_exponent=float(d.get("memory_ramp_exponent", 1.0)),
        peak_flops_per_s=peak_flops_per_s,
        peak_bytes_per_s=peak_bytes_per_s,
        compute_efficiency_max=float(d["compute_efficiency_max"]),
        compute_half_flops=float(d["compute_half_gflop"]) * 1e9,
        compute_ramp_exponent=float(d["compute_ramp_exponent"]),
        memory_efficiency=float(d["memory_efficiency"]),
        kernel_floor_s=float(d["kernel_floor_us"]) * 1e-6,
    )


def attention_from_dict(d: dict, peak_flops_per_s: float, peak_bytes_per_s: float) -> AttentionCurves:
    """The profile's `attention` block: a `gemm`-style fit for `context` and one for `generation`."""
    return AttentionCurves(gemm_curve_from_dict(d["context"], peak_flops_per_s, peak_bytes_per_s),
                           gemm_curve_from_dict(d["generation"], peak_flops_per_s, peak_bytes_per_s))


def elementwise_from_dict(d: dict, peak_bytes_per_s: float) -> ElementwiseCost:
    """The profile's `elementwise` block: kernels per layer, floor (us), memory efficiency."""
    return ElementwiseCost(int(d["kernels_per_layer"]), float(d["floor_us"]) * 1e-6,
                           peak_bytes_per_s * float(d["memory_efficiency"]))


def allreduce_from_dict(d: dict) -> AllReduceTable:
    """The profile's `allreduce_us` block: {"tp": [[bytes, microseconds], ...]}."""
    return AllReduceTable(tuple(sorted(
        (int(tp), tuple((float(b), float(us) * 1e-6) for b, us in pts)) for tp, pts in d.items()
    )))


def layer_gemms(g: BlockGeometry, tp: int) -> tuple[tuple[int, int], ...]:
    """Per-rank (n, k) of one layer's GEMM kernels: QKV, attention output, MLP up, MLP down."""
    q_rank = -(-g.q_heads // tp) * g.head_dim
    kv_rank = -(-g.kv_heads // tp) * g.head_dim  # fewer K/V heads than ranks: each rank keeps one
    return ((q_rank + 2 * kv_rank, g.d_model), (g.d_model, q_rank),
            (-(-2 * g.d_ff // tp), g.d_model), (g.d_model, -(-g.d_ff // tp)))
