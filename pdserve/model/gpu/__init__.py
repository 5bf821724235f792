"""The engine's CUDA kernels, written in Triton: paged attention over the K/V pool read in place
through block tables (attention.py), a batch-invariant GEMM (gemm.py) and the residual add +
RMSNorm (norm.py).

Contract: nothing here is imported by a CPU-only run's hot path unless a tensor is on a CUDA
device; `available()` says whether CUDA and Triton are both present. Every kernel's launch
configuration is fixed (never tuned per shape), so a row's bits depend on its own inputs only:
its batch mates, its place in the batch and the batch's size never change them.
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def triton_present() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def available() -> bool:
    """CUDA and Triton both present (the kernels' launch needs both)."""
    return torch.cuda.is_available() and triton_present()


def serves(t: torch.Tensor) -> bool:
    """Whether the Triton kernels take this tensor (a CUDA tensor, Triton importable)."""
    return t.device.type == "cuda" and triton_present()
