"""bf16 weights reordered once at load into oneDNN's blocked layout, so no product repacks them.

Why: `F.linear` on bf16 CPU tensors calls oneDNN, which reorders the plain [N, K] weight into
its blocked layout on every call. Reordering once at load (`mkldnn._reorder_linear_weight`) and
calling `mkldnn._linear_pointwise` measured, per product on one thread of an AVX512-BF16 EPYC
(107M checkpoint shapes, CPU time): 1 row 0.72 -> 0.30 ms for the 6144 x 768 gate|up product,
32 rows 2.7 -> 2.1 ms, 512 rows 25.8 -> 24.1 ms (docs/engine_speed.md).

Contract: `PackedWeight(w)(x, bias)` equals `F.linear(x, w, bias)` bit for bit (the same oneDNN
kernels; `available()` checks that on this machine before anything is packed, and the
batch-invariance probe runs on the packed products). bf16 only: fp32 products stay on MKL.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 32  # oneDNN's reorder takes an expected row count; any row count may then be used


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether this torch build packs bf16 weights for oneDNN and the packed products equal F.linear."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(7)
        w = torch.randn(96, 80, generator=gen).to(torch.bfloat16)  # [N, K]
        bias = torch.randn(96, generator=gen).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        for rows in (1, 5, 40):
            x = torch.randn(rows, 80, generator=gen).to(torch.bfloat16)
            for b in (None, bias):
                if not torch.equal(_packed_linear(x, packed, b), F.linear(x, w, b)):
                    return False
        return True
    except (AttributeError, RuntimeError):
        return False


class PackedWeight:
    """A bf16 weight [N, K] held only packed (one copy of its bytes); `weight` rebuilds the plain
    tensor on demand (numerics.dense: rare, not per step)."""

    def __init__(self, weight: torch.Tensor):  # [N, K] bf16
        self.shape = tuple(weight.shape)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)

    @property
    def weight(self) -> torch.Tensor:  # [N, K] bf16, reordered back from oneDNN's layout
        return self.packed.to_dense()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, K] bf16 -> [T, N] bf16."""
        return _packed_linear(x, self.packed, bias)

    def raw(self) -> torch.Tensor | None:
        """oneDNN's blocked bytes as a flat bf16 tensor over the same memory (valid while this
        PackedWeight lives; nothing may write it), or None where this torch does not expose them."""
        try:
            nbytes, address = torch.ops.mkldnn._nbytes(self.packed), torch.ops.mkldnn.data_ptr(self.packed)
        except (AttributeError, RuntimeError):
            return None
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """A PackedWeight for a 2-D bf16 weight where oneDNN packing is available; else the weight."""
    if weight.dtype == torch.bfloat16 and weight.dim() == 2 and available():
        return PackedWeight(weight.contiguous())
    return weight
