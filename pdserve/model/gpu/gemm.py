"""A batch-invariant matrix product on the GPU: y = x @ w.T in one fixed tiling.

Why: cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, so a row's bits can
change with the number of rows beside it; a prefill worker and a colocated worker would then
disagree on the same request. Here every output tile sums over K in BLOCK_K steps from 0 to K,
in one order, whatever M is; rows never meet (each output element is one row's dot product), so
a row's result depends only on the row and the weight. The launch configuration is a constant,
never autotuned by shape. Accumulation is fp32; fp32 inputs multiply in full fp32 ("ieee", not
tf32), so fp32 models keep fp32 accuracy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
GROUP_M = 8  # tiles of 8 row blocks share weight columns in L2 (the launch order, not the arithmetic)


@triton.jit
def _matmul(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
            IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GM * tiles_n)
    first_m = group * GM
    size_m = tl.minimum(tiles_m - first_m, GM)
    pid_m = first_m + (pid % (GM * tiles_n)) % size_m
    pid_n = (pid % (GM * tiles_n)) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        b = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
        acc += b.to(tl.float32)  # one rounding of product + bias, as cuBLAS's bias epilogue
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (rows contiguous); w: [N, K] contiguous; bias: [N] | None -> [M, N] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
        _matmul[grid](x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                      HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                      BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, GM=GROUP_M, num_warps=4, num_stages=3)
    return y


class GemmWeight:
    """A weight [N, K] whose products run through `matmul` (the "triton" product plan)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()  # [N, K]
        self.shape = tuple(self.weight.shape)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return matmul(x, self.weight, bias)
