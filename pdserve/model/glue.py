"""A decoder layer's elementwise glue: residual add + RMSNorm, SiLU * up and RoPE, one C pass each
(eager torch where no C compiler works).

Why: an eager layer ran ~35 torch operators (RMSNorm alone is eight: float, pow, mean, add, rsqrt,
mul, to, mul), ~600 per decode step, each a dispatch plus a pass over memory; at decode @1 they
cost ~4 ms of a ~20 ms step (docs/engine_speed.md). `csrc/glue.c` does each in one call.

Contract (bf16 or fp32 activations, [T, d] contiguous):
- `add_rms_norm(x, delta, weight, eps)` adds delta into x in place (the residual, rounded as torch's
  add) and returns weight * RMSNorm(x) with the reduction in fp32 and the normalised value rounded
  to x's dtype before the weight, as transformers' LlamaRMSNorm; `delta=None` only normalises.
  The sum of squares runs in a fixed order of the row's own (not torch's), so the norm may
  differ from eager torch in the last bit of the fp32 scale (never within one machine between
  rows, batches or thread counts: a row's result depends on the row alone).
- `silu_mul(gate_up)` is silu(gate) * up over a [T, 2F] gate|up product, each operator rounded
  as torch rounds it; e^-x is computed by the C file's own polynomial (about an ulp from torch's).
- `rope_(qkv, heads, head_dim, positions, cos, sin_rot)` rotates the first `heads` heads of
  every row of qkv [T, W] in place: bit for bit `x * cos + roll(x, D/2) * sin_rot` in eager torch
  (see llama.apply_rope), each product and the sum rounded to the dtype as torch rounds them.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.model import ckernel, gpu, paged_decode

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
# smaller calls run on the calling thread (an OpenMP region costs more than the work): 64 rows of a 768-wide norm;
# SiLU * up of 32 rows x 3072 at 2 threads (wall, min of 300, OpenMP workers awake) 93 -> 52 us, 16 rows 52 -> 29 us
PARALLEL_ELEMENTS = 64 * 768


_library = ckernel.Binding("glue", {
    "glue_add_rms_norm": (None, [_P] * 4 + [_I64, _I64, ctypes.c_float, ctypes.c_int, ctypes.c_int]),
    "glue_silu_mul": (None, [_P, _P, _I64, _I64, ctypes.c_int, ctypes.c_int]),
    "glue_rope": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int, ctypes.c_int]),
})
_bound = _library.bound  # the build for another -march (tests)


def available() -> bool:
    return _library() is not None


def _threads(rows: int, width: int) -> int:
    """OpenMP threads for a call over rows x width values (1 in a forked child)."""
    return torch.get_num_threads() if rows * width >= PARALLEL_ELEMENTS and paged_decode.openmp() else 1


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in (torch.float32, torch.bfloat16) and t.is_contiguous() and t.device.type == "cpu"
               for t in tensors) and available()


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., d] -> [..., d]; transformers' formula in torch operators (the fallback and Qwen3's q/k norms)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, d] (updated in place by delta [T, d] when given); weight: [d] -> [T, d]."""
    if delta is not None:
        delta = delta.contiguous()  # a tiled product's output may be a strided view
    parts = (x, weight) if delta is None else (x, delta, weight)
    if x.dim() == 2 and gpu.serves(x) and x.is_contiguous():  # one Triton program per row (model/gpu/norm.py)
        from pdserve.model.gpu.norm import add_rms_norm as gpu_add_rms_norm
        return gpu_add_rms_norm(x, delta, weight, eps)
    if x.dim() != 2 or not _fits(*parts) or len({t.dtype for t in parts}) != 1:
        if delta is not None:
            x.add_(delta)
        return rms_norm_eager(x, weight, eps)
    out = torch.empty_like(x)
    rows, d = x.shape
    _library().glue_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                 out.data_ptr(), rows, d, eps, int(x.dtype == torch.bfloat16), _threads(rows, d))
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin_rot: torch.Tensor) -> bool:
    """qkv: [T, W] with stride(1) == 1; positions: [T] int64; cos, sin_rot: [P, D] tables in qkv's
    dtype. Rotates in place and returns True, or returns False (nothing done) where the C glue
    cannot take these tensors."""
    if not (qkv.dim() == 2 and qkv.stride(1) == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
            and _fits(cos, sin_rot) and qkv.dtype == cos.dtype == sin_rot.dtype):
        return False
    _library().glue_rope(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, head_dim, positions.data_ptr(),
                         cos.data_ptr(), sin_rot.data_ptr(), int(qkv.dtype == torch.bfloat16),
                         _threads(qkv.shape[0], heads * head_dim))
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2F] (gate columns, then up) -> [T, F] = silu(gate) * up, rounded as eager torch
    rounds each operator; e^-x is the C file's own (within an ulp of torch's)."""
    rows, width = gate_up.shape
    if not _fits(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    out = gate_up.new_empty(rows, width // 2)
    _library().glue_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, int(gate_up.dtype == torch.bfloat16),
                             _threads(rows, width // 2))
    return out
