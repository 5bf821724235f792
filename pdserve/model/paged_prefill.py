"""Causal prefill attention read from the paged K/V pool (a C kernel), in place of SDPA.

Why: torch's SDPA flash kernel took ~79 ms of a 512-token prefill on the 107M checkpoint (12
layers, 2 threads of an AVX512-BF16 EPYC) for attention that needs ~0.4 GFLOP per layer, and a
chunk after cached context first gathered its K/V into a padded copy and ran SDPA with a
boolean mask (docs/engine_speed.md). `csrc/paged_prefill.c` reads each chunk's visible keys from
the pool through its block table, widens them once to fp32, and works in (K/V head, 16 query
rows) items: the G query heads that share a K/V head are scored together against 16 keys per
vector, an fp32 softmax per row over exactly its visible keys, then the values.

Contract: `prefill_attention(q, cache_k, cache_v, block_table, ctx_len)` for a chunk of S new rows
at positions ctx_len - S .. ctx_len - 1 (already written into the pool) equals causal
softmax(q K^T / sqrt(D)) V over each row's keys 0 .. its own position, computed in fp32 (bf16
pool entries and queries widen exactly) and returned in q's dtype. A row's bits depend only on
its query, its position and the keys it sees: not on the chunk's other rows, how the prompt was
cut into chunks, the thread count or the work split (the C file says why); a bf16 query over a
bf16 pool gives the fp32 query's result bit for bit (on an AVX512-BF16 CPU its scores run as bf16
dot products, in the order the fp32 path sums them). Items run on torch's
OpenMP threads (`model/ckernel.py`); in a forked child, where that runtime's pool does not
survive, on one thread. With no C compiler `available()` is False and attention.py keeps SDPA.
The pool may be a tensor-parallel rank's strided view of its heads, as for paged_decode.
"""

from __future__ import annotations

import ctypes

import torch
import torch.profiler

from pdserve.model import ckernel, paged_decode

_I64 = ctypes.c_int64


_library = ckernel.Binding("paged_prefill", {
    "paged_prefill": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, _I64] + [ctypes.c_void_p] * 2
                      + [ctypes.c_int, ctypes.c_void_p, _I64, _I64, ctypes.c_void_p] + [_I64] * 6 + [ctypes.c_int]),
})
_bound = _library.bound  # the build for another -march (tests)


def available() -> bool:
    """Whether the kernel is built (or buildable) on this machine."""
    return _library() is not None


def eligible(cache: torch.Tensor) -> bool:
    """cache: [N, B, H_kv, D]: the same pools paged_decode takes (fp32/bf16, D % 16 == 0, <= 256)."""
    return paged_decode.eligible(cache) and available()


def prefill_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_table: torch.Tensor,
                      ctx_len: int) -> torch.Tensor:
    """q: [S, H_q, D]; cache_*: [N, B, H_kv, D] with dense [H_kv, D] rows (same strides);
    block_table: [>= ceil(ctx_len / B)] int64 -> [S, H_q, D] in q's dtype."""
    q_len, num_q_heads, head_dim = q.shape
    dtype = q.dtype
    _, block_size, num_kv_heads, _ = cache_k.shape
    if not (paged_decode.dense_heads(cache_k) and cache_v.stride() == cache_k.stride()):
        raise ValueError("prefill_attention reads the pool in place: each key row's [H_kv, D] must be contiguous, "
                         "with the same strides in cache_k and cache_v")
    if not 1 <= q_len <= ctx_len <= block_table.shape[0] * block_size:
        raise ValueError(f"a chunk of {q_len} rows cannot end at context {ctx_len} with {block_table.shape[0]} blocks")
    if q.dtype not in (torch.float32, torch.bfloat16) or q.stride()[1:] != (head_dim, 1):
        q = q.float().contiguous()  # the kernel reads fp32/bf16 rows of contiguous heads, at any row stride
    table = block_table.to(torch.int64).contiguous()  # [M]
    out = torch.empty(q.shape, dtype=torch.float32)  # [S, H_q, D]
    threads = torch.get_num_threads() if paged_decode.openmp() else 1
    with torch.profiler.record_function("pdserve::paged_prefill"):  # named in profiles (not an aten op)
        status = _library().paged_prefill(
            q.data_ptr(), int(q.dtype == torch.bfloat16), q.stride(0), cache_k.data_ptr(), cache_v.data_ptr(),
            int(cache_k.dtype == torch.bfloat16),
            table.data_ptr(), q_len, ctx_len, out.data_ptr(), block_size, cache_k.stride(0), cache_k.stride(1),
            num_kv_heads, head_dim, num_q_heads, threads)
    if status == -2:
        raise ValueError("paged_prefill needs a head_dim that is a multiple of 16, at most 256")
    if status:
        raise MemoryError("paged_prefill could not allocate its scratch")
    return out.to(dtype)
