"""bf16 matrix products of the engine's own (`csrc/bf16_gemm.c`) for CPUs without bf16 dot products.

Why: on an x86 CPU without AVX512-BF16/AMX (and so without oneDNN's bf16 kernels), a bf16
`F.linear` is ATen's fp32-accumulating dot product per output element: near memory speed for one
row, but it reads the weights once per row, so a 32-row decode step of the 107M checkpoint cost
~26x a one-row step (427 vs 16.4 ms for its 48 products, one thread); fp32 GEMMs over weights
upcast once are faster at 32+ rows but stream twice the bytes at one row, and batch invariance
forbids picking a library kernel by row count (numerics.py). This kernel reads each weight byte
once per call and reuses it across up to six rows held in registers (docs/engine_speed.md).

Contract: `KernelWeight(w)(x)` for a bf16 weight w [N, K] and bf16 x [T, K] (rows at any stride,
elements contiguous) returns [T, N] bf16: each element the fp32 fused multiply-add chain
sum_{i = 0..K-1} x[t, i] * w[n, i] taken in index order from zero, rounded once to bf16. That order
is fixed per element, so a row's bits depend on the row and the weight alone: not on how many rows
share the call, where the row sits, the thread count, or whether the build is AVX2 or AVX-512
(numerics.py's "kernel" plan rests on this). Within fp32 rounding of the exact product, like
torch's bf16 products, but not bitwise theirs. The weight is re-laid out once at construction
into panels of 16 columns (`pack`: a second copy of the weight's bytes, as oneDNN's packing holds);
`weight` keeps the plain tensor for readers of the values. Work is split over torch's threads by output columns.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.model import ckernel

PANEL = 16  # output columns per packed panel (csrc/bf16_gemm.c)
# a panel's 16 bf16 values at one k hold columns (0, 8, 1, 9, ..., 7, 15): one 32-byte load widens
# into columns 0-7 (even halves shifted up) and 8-15 (odd halves masked), no shuffle
_LANE_COLUMNS = [c for pair in zip(range(8), range(8, 16)) for c in pair]
_COLUMN_LANES = [_LANE_COLUMNS.index(c) for c in range(16)]  # the inverse: column c sits in lane _COLUMN_LANES[c]
PARALLEL_WORK = 1 << 21  # rows * N * K below this run on the calling thread (a parallel region costs more)
_I64 = ctypes.c_int64
_P = ctypes.c_void_p

_library = ckernel.Binding("bf16_gemm", {
    "bf16_gemm": (ctypes.c_int, [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, ctypes.c_int]),
    "bf16_gemm_openmp": (ctypes.c_int, []),
    "bf16_gemm_vector": (ctypes.c_int, []),
})
_bound = _library.bound  # the build for another -march (tests)


def available() -> bool:
    """Whether the kernel is built (or buildable) on this machine."""
    return _library() is not None


def vectorised() -> bool:
    """Whether the build runs AVX2 + FMA vectors (else the scalar loop: same bits, far slower)."""
    lib = _library()
    return lib is not None and bool(lib.bf16_gemm_vector())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [N, K] bf16 -> [ceil(N / 16), K, 16] bf16, zero columns padding the last panel."""
    n, k = weight.shape
    pad = -n % PANEL
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, k)])
    panels = weight.view(-1, PANEL, k)[:, _LANE_COLUMNS]  # [P, 16, K] in lane order
    return panels.transpose(1, 2).contiguous()  # [P, K, 16]


def _threads(work: int) -> int:
    return ckernel.threads_for(work, PARALLEL_WORK, _library().bf16_gemm_openmp)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x: [T, K] bf16 (rows at any stride); packed: pack(w) of w [n, K] -> [T, n] bf16."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or packed.shape[1] != k:
        raise ValueError(f"bf16_linear takes bf16 [T, {packed.shape[1]}] rows, got {x.dtype} {tuple(x.shape)}")
    if packed.dtype != torch.bfloat16 or not packed.is_contiguous() or packed.shape[0] != -(-n // PANEL) \
            or packed.shape[2] != PANEL:  # the kernel reads ceil(n / 16) whole panels
        raise ValueError(f"packed {packed.dtype} {tuple(packed.shape)} is not pack() of a weight of {n} rows")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=torch.bfloat16)  # [T, n]
    if rows == 0:
        return out
    call = (x.data_ptr(), x.stride(0), rows, k, packed.data_ptr(), n, out.data_ptr(), n, _threads(rows * n * k))
    status = ckernel.named("pdserve::bf16_gemm", _library().bf16_gemm, *call)
    if status:
        raise MemoryError("bf16_gemm could not allocate its fp32 copy of the rows")
    return out


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack`: [ceil(n / 16), K, 16] -> the plain [n, K] weight (a new tensor)."""
    panels = packed.transpose(1, 2)[:, _COLUMN_LANES]  # [P, 16, K] in column order
    return panels.reshape(-1, packed.shape[1])[:n].contiguous()


class KernelWeight:
    """A bf16 weight [N, K] held only packed into 16-column panels for the kernel (one copy of
    its bytes); `weight` rebuilds the plain tensor on demand (numerics.dense: rare, not per step)."""

    def __init__(self, weight: torch.Tensor):  # [N, K] bf16
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise TypeError(f"KernelWeight takes a 2-D bf16 weight, got {weight.dtype} {tuple(weight.shape)}")
        self.n = weight.shape[0]
        self.packed = pack(weight.contiguous())  # [ceil(N / 16), K, 16]

    @property
    def weight(self) -> torch.Tensor:  # [N, K] bf16, unpacked
        return unpack(self.packed, self.n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] bf16 -> [T, N] bf16."""
        return bf16_linear(x, self.packed, self.n)
