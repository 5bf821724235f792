"""Compute dtype policy and batch-invariant matrix products.

Contract:
- The *storage* dtype (`EngineConfig.dtype`) is what weights are rounded to and what the K/V
  pool holds: it fixes the K/V ABI, the bytes a handoff moves and the values every reader sees.
- The *compute* dtype is what activations and matmuls use; by default the storage dtype. On an
  x86 CPU without native bf16 dot products (no AVX512-BF16 / AMX-BF16) PyTorch's bf16 GEMM runs
  3-6x slower than fp32 at prefill sizes, while bf16 weights halve the bytes a small-batch decode
  step streams; `compute_dtype="float32"` over bf16 storage trades the second for the first.
  Weights are then bf16-rounded values held in fp32 (exact), products accumulate in fp32, and K/V
  rows are rounded to bf16 on their way into the pool and read back from those rounded values,
  so a sequence sees the same K/V whether it computed them, hit the prefix cache or imported them.
- Batch invariance (`EngineConfig.batch_invariant`, on by default): a row's result must not depend
  on its batch mates (tested in tests/model/test_numerics.py). PyTorch's CPU bf16 GEMM already
  is; MKL's fp32 GEMM switches kernels (GEMV at one row, other tails below a dozen rows), so fp32
  rows are padded to a multiple of ROW_QUANTUM, with which every row sees the same kernel and
  summation order. The price is small-batch fp32 decode: one row costs a 4-row GEMM instead of a
  GEMV (`--no-batch-invariant` trades exactness across batch compositions for that speed).
- Without batch invariance, fp32 on one thread, products of 2-8 rows go through skinny.py's
  kernel (one pass over the weights instead of MKL's small-row GEMM, which reads them per row).
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.model import skinny

ROW_QUANTUM = 4
COMPUTE_CHOICES = ("float32", "bfloat16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when the CPU advertises bf16 dot-product instructions (or is not x86). Reported by
    bench-engine, whose bf16 ratios depend on it."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return any(flag in flags.split() for flag in _NATIVE_BF16_FLAGS)


def resolve_compute_dtype(storage: str, requested: str | None = None) -> torch.dtype:
    """(storage dtype name, None | dtype name) -> the torch dtype activations and matmuls use."""
    for name in (storage, requested or storage):
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected one of {COMPUTE_CHOICES}")
    return _DTYPES[requested or storage]


def row_quantum(compute: torch.dtype, batch_invariant: bool) -> int:
    """Rows a product is padded to a multiple of: ROW_QUANTUM for batch-invariant fp32, else 1."""
    return ROW_QUANTUM if batch_invariant and compute == torch.float32 else 1


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, quantum: int = 1, skinny_rows: bool = False
) -> torch.Tensor:
    """x: [T, in] -> [T, out]; rows padded to a multiple of `quantum` for the product; with
    `skinny_rows` (see skinny.eligible) 2-8 rows go through the skinny kernel."""
    if skinny_rows and skinny.applies(x):
        return skinny.skinny_linear(x, weight, bias)
    rows = x.shape[0]
    pad = -rows % quantum
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return F.linear(x, weight, bias)[:rows]
    return F.linear(x, weight, bias)
