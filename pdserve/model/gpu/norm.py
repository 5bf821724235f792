"""Residual add + RMSNorm on the GPU, one Triton program per row.

Contract: `add_rms_norm(x, delta, weight, eps)` adds delta into x in place (each sum rounded to
x's dtype, as torch's add) and returns weight * RMSNorm(x): the mean of squares in fp32 over the
row in one fixed order (a row's own, whatever the batch), the normalised value rounded to x's
dtype before the weight is applied, as transformers' LlamaRMSNorm. torch's own CUDA reduction
picks its split of a row by the tensor's shape, so a row could sum in another order beside other
rows: this kernel never does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, d_ptr, w_ptr, out_ptr, width, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=keep, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * width + cols, mask=keep, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * width + cols, x, mask=keep)
    xf = x.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / width + eps)
    normed = (xf * scale).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0)
    tl.store(out_ptr + row * width + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=keep)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, d] contiguous (updated in place by delta [T, d]); weight: [d] -> [T, d]."""
    rows, width = x.shape
    out = torch.empty_like(x)
    if rows:
        delta = x if delta is None else delta.contiguous()
        _add_rms_norm[(rows,)](x, delta, weight, out, width, eps, HAS_DELTA=delta is not x,
                               BLOCK=triton.next_power_of_2(width), num_warps=4 if width <= 4096 else 8)
    return out
