"""Skinny fp32 matrix products for small decode batches (numba), one pass over the weights.

Why: on one thread, PyTorch's CPU fp32 `linear` uses a GEMV for one row but a GEMM for two to a
dozen rows, and that GEMM streams the weight matrix about once per row: a decode step of the
`small` model measured 63 ms at batch 1, 131 ms at batch 2 and 190 ms at batch 4, ~85% of it in
`aten::mm`. Decode is bound by the bytes of weights read, so this kernel reads each weight row
once and multiplies it into up to four activation rows held in registers (blocks of four rows):
batch 2-4 then cost about what batch 1 costs (`pdserve bench-engine` reports it).

Contract: `skinny_linear(x, weight, bias)` equals `F.linear(x, weight, bias)` up to fp32
rounding (the summation order differs), for `x` [T, in] fp32 with 1 <= T <= MAX_ROWS and `weight`
[out, in] fp32. The vectorised summation order depends on how many rows share a block, so a
row's last bits can depend on its batch mates: the engine uses this only when batch invariance
is off (numerics.py) and torch runs on one thread (with more threads MKL's GEMM is
parallel and this single-threaded loop is not). The kernel releases the GIL, like torch's ops,
so handoff threads keep running during a decode step. numba is imported when the kernel is first
compiled (`warm_up`), not with this module: a bf16 or batch-invariant engine never loads it
(~55 MiB of a worker's RSS: numba and LLVM).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import numpy as np
import torch

AVAILABLE = importlib.util.find_spec("numba") is not None  # else the engine keeps torch's products
MAX_ROWS = 8  # above this torch's GEMM is faster than blocks of four rows (measured on AVX2)
MIN_ROWS = 2  # one row: torch's GEMV already reads the weights once


def _rows_block(x, w, out, m0, rows):  # x [T, K], w [N, K], out [T, N]; rows in 1..4 from m0
    num_out, k_dim = w.shape
    if rows == 4:
        x0, x1, x2, x3 = x[m0], x[m0 + 1], x[m0 + 2], x[m0 + 3]
        for n in range(num_out):
            wr = w[n]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(k_dim):
                wk = wr[k]
                a0 += x0[k] * wk
                a1 += x1[k] * wk
                a2 += x2[k] * wk
                a3 += x3[k] * wk
            out[m0, n], out[m0 + 1, n], out[m0 + 2, n], out[m0 + 3, n] = a0, a1, a2, a3
    elif rows == 3:
        x0, x1, x2 = x[m0], x[m0 + 1], x[m0 + 2]
        for n in range(num_out):
            wr = w[n]
            a0 = a1 = a2 = np.float32(0.0)
            for k in range(k_dim):
                wk = wr[k]
                a0 += x0[k] * wk
                a1 += x1[k] * wk
                a2 += x2[k] * wk
            out[m0, n], out[m0 + 1, n], out[m0 + 2, n] = a0, a1, a2
    elif rows == 2:
        x0, x1 = x[m0], x[m0 + 1]
        for n in range(num_out):
            wr = w[n]
            a0 = a1 = np.float32(0.0)
            for k in range(k_dim):
                wk = wr[k]
                a0 += x0[k] * wk
                a1 += x1[k] * wk
            out[m0, n], out[m0 + 1, n] = a0, a1
    else:
        x0 = x[m0]
        for n in range(num_out):
            wr = w[n]
            a0 = np.float32(0.0)
            for k in range(k_dim):
                a0 += x0[k] * wr[k]
            out[m0, n] = a0


def _skinny(x, w, out):
    m0 = 0
    while m0 < x.shape[0]:
        rows = min(4, x.shape[0] - m0)
        _rows_block(x, w, out, m0, rows)
        m0 += rows
    return out


@lru_cache(maxsize=1)
def _kernel():
    """`_skinny` compiled (or loaded from numba's disk cache), with `_rows_block` inlined."""
    import numba

    global _rows_block  # the jitted `_skinny` resolves it among the module's globals when it compiles
    # fastmath lets LLVM vectorise the dot products (reassociation); cache: compiled once per machine
    _rows_block = numba.njit(fastmath=True, cache=True, nogil=True, inline="always")(_rows_block)
    return numba.njit(fastmath=True, cache=True, nogil=True)(_skinny)


def eligible(compute_dtype: torch.dtype, batch_invariant: bool) -> bool:
    """Whether a model with this compute dtype and invariance setting should use the kernel."""
    return AVAILABLE and compute_dtype == torch.float32 and not batch_invariant and torch.get_num_threads() == 1


def applies(x: torch.Tensor) -> bool:
    return MIN_ROWS <= x.shape[0] <= MAX_ROWS


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, in] fp32 (T <= MAX_ROWS), weight: [out, in] fp32 -> [T, out]."""
    if weight.dtype != torch.float32 or x.dtype != torch.float32:
        raise TypeError("skinny_linear is fp32 only")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)  # [T, out]
    _kernel()(x.detach().contiguous().numpy(), weight.detach().contiguous().numpy(), out.numpy())
    return out if bias is None else out.add_(bias)


def warm_up() -> None:
    """Compile (or load from the disk cache) the kernel before the first step needs it."""
    if AVAILABLE:
        x = torch.ones(MAX_ROWS, 8)
        skinny_linear(x, torch.ones(3, 8))
