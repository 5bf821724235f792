"""Decode attention read in place from the paged K/V pool (a small C kernel), no padded copy.

Why: the plain-PyTorch decode path gathers every sequence's blocks into a padded [g, H_kv, M*B, D]
copy (`index_select`) and runs SDPA with an additive mask over it; on the 107M checkpoint at batch
32 x 512 context that costs ~6.6 ms per layer on 2 threads of an AVX512-BF16 EPYC, most of it in
SDPA's small-query path (docs/engine_speed.md). `csrc/paged_decode.c` walks each row's block
table in place instead: for one (row, K/V head) it scores the G = H_q / H_kv query heads that
share the head against every visible key, takes an fp32 softmax and sums the values.

Contract: `decode_attention(q, cache_k, cache_v, block_tables, context_lens)` equals
softmax(q K^T / sqrt(D)) V over each row's first `context_lens[i]` keys, computed in fp32 (bf16
pool entries widen exactly) and returned in q's dtype; a bf16 query gives the fp32 query's result
rounded (on an AVX512-BF16 CPU its scores run as bf16 dot products, in the order the fp32 path
sums them: the C file says which). A row's result depends only on its own
query, block table and length (the C loops run in an order fixed by the row's length), so it is
batch-invariant by construction and bitwise the same for any thread count: rows are split across
`torch.get_num_threads()` threads. Built with `-fopenmp`, the kernel splits them itself, in
contiguous runs of (row, K/V head) items (a head's arithmetic does not depend on which thread's
run it falls in, so 3 rows split as evenly over 2 threads as 4 do, and a lone row's heads spread
over the threads too); without OpenMP, at most one Python thread per row. It uses the
process's one GNU OpenMP runtime: the shared object names libgomp.so.1, which resolves to the copy
torch already loaded, so the kernel runs on torch's own worker threads (the ones that just ran
the GEMMs and spin waiting for the next parallel region) instead of a second pool competing with
them for the cores; without OpenMP, Python threads each call the kernel on their own rows
(ctypes releases the GIL).

The pool may be a tensor-parallel rank's strided view of its K/V heads: the kernel takes the
block and key-row strides, so a rank's rows for its heads are bitwise the whole-pool kernel's
rows for those heads (each query head reads only its own K/V head).

The kernel is compiled once per machine (`model/ckernel.py`: `cc -O3 -march=native`, cached
under ~/.cache/pdserve/ keyed by source, flags and CPU); with no C compiler `available()` is
False and attention.py keeps its gather + SDPA path. Because the build targets the local CPU, two machines
of different kinds may differ in a decode row's last bits (not within one machine).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.model import ckernel

_POOL_DTYPES = (torch.float32, torch.bfloat16)
_I64 = ctypes.c_int64


_library = ckernel.Binding("paged_decode", {
    "paged_decode": (ctypes.c_int, [ctypes.c_void_p, _I64, ctypes.c_int] + [ctypes.c_void_p] * 2
                     + [ctypes.c_int, ctypes.c_void_p, _I64, ctypes.c_void_p, ctypes.c_void_p] + [_I64] * 9 + [ctypes.c_int]),
    "paged_decode_openmp": (ctypes.c_int, None),
})
_bound = _library.bound  # the build for another -march (tests)


def available() -> bool:
    """Whether the kernel is built (or buildable) on this machine."""
    return _library() is not None


def eligible(cache: torch.Tensor) -> bool:
    """cache: [N, B, H_kv, D]; the kernel takes fp32/bf16 pools with D a multiple of 16, up to 256,
    whose heads are D apart and each head's D values contiguous (a whole pool, or a
    tensor-parallel rank's view of some of its heads)."""
    head_dim = cache.shape[-1]
    return (cache.device.type == "cpu" and cache.dtype in _POOL_DTYPES and head_dim % 16 == 0 and head_dim <= 256 and dense_heads(cache)
            and available())


def dense_heads(cache: torch.Tensor) -> bool:
    """cache: [N, B, H, D] whose last two axes are dense ([H, D] rows, maybe a slice of wider rows)."""
    return cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]


_executor: ThreadPoolExecutor | None = None
_executor_key: tuple[int, int] = (0, 0)  # (pid, workers): a forked child must not reuse its parent's threads


def openmp() -> bool:
    """Whether the built kernel splits rows over OpenMP threads itself: not in a forked child,
    where the runtime's inherited pool has no threads behind it and a parallel region hangs
    (torch's own parallel ops hang there too; the Python-thread split still works)."""
    lib = _library()
    return lib is not None and bool(lib.paged_decode_openmp()) and ckernel.openmp_usable()


def _run(calls: list[tuple]) -> None:
    global _executor, _executor_key
    lib = _library()
    if len(calls) == 1:
        status = [lib.paged_decode(*calls[0])]
    else:
        if _executor is None or _executor_key != (os.getpid(), len(calls) - 1):
            _executor = ThreadPoolExecutor(max_workers=len(calls) - 1, thread_name_prefix="paged-decode")
            _executor_key = (os.getpid(), len(calls) - 1)
        futures = [_executor.submit(lib.paged_decode, *c) for c in calls[1:]]
        status = [lib.paged_decode(*calls[0])] + [f.result() for f in futures]
    if -2 in status:
        raise ValueError("paged_decode needs a head_dim that is a multiple of 16, at most 256")
    if any(status):
        raise MemoryError("paged_decode could not allocate its scratch")


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q: [Bd, H_q, D]; cache_*: [N, B, H_kv, D] fp32 or bf16 with dense [H_kv, D] rows (strides
    equal between K and V; a TP rank's head slice of a pool is fine); block_tables: [Bd, M]
    int64; context_lens: [Bd] int64, each in 1..M*B -> [Bd, H_q, D] in q's dtype."""
    rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, pool_head_dim = cache_k.shape
    strides = cache_k.stride()
    if not (strides[3] == 1 and strides[2] == pool_head_dim and cache_v.stride() == strides):  # dense_heads
        raise ValueError("decode_attention reads the pool in place: each key row's [H_kv, D] must be contiguous, "
                         "with the same strides in cache_k and cache_v")
    qf = q.detach()  # bf16 rows are widened in C (and the result rounded back), read at their row stride
    q_strides = qf.stride()
    if qf.dtype != torch.bfloat16 or q_strides[2] != 1 or q_strides[1] != head_dim:
        qf = qf.float().contiguous()  # [Bd, H_q, D]
    tables = block_tables if block_tables.dtype == torch.int64 and block_tables.is_contiguous() else \
        block_tables.to(torch.int64).contiguous()  # [Bd, M]
    lens = context_lens if context_lens.dtype == torch.int64 and context_lens.is_contiguous() else \
        context_lens.to(torch.int64).contiguous()  # [Bd]
    out = torch.empty(qf.shape, dtype=qf.dtype)  # [Bd, H_q, D], contiguous
    q_bf16 = int(qf.dtype == torch.bfloat16)
    max_len = tables.shape[1] * block_size  # sizes the score scratch; no per-call sync on lens.max()
    if openmp():  # OpenMP threads inside one call, over (row, K/V head) items, a lone row's heads too: on a
        # near-quiet machine that won (decode @1 steps at 2 threads 16.85 -> 16.3 ms), under load 3.5-9 it lost
        # (65 vs 61 ms), docs/engine_speed.md §8, §10
        inner, cuts = max(1, min(torch.get_num_threads(), rows * num_kv_heads)), [0, rows]
    else:  # one Python thread per cut of the rows
        threads = max(1, min(torch.get_num_threads(), rows))
        inner, cuts = 1, [rows * k // threads for k in range(threads + 1)]
    head = (qf.data_ptr(), qf.stride(0), q_bf16, cache_k.data_ptr(), cache_v.data_ptr(),
            int(cache_k.dtype == torch.bfloat16), tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr())
    tail = (max_len, block_size, strides[0], strides[1], num_kv_heads, head_dim, num_q_heads, inner)
    calls = [(*head, cuts[k], cuts[k + 1], *tail) for k in range(len(cuts) - 1) if cuts[k + 1] > cuts[k]]
    ckernel.named("pdserve::paged_decode", _run, calls)
    return out if out.dtype == q.dtype else out.to(q.dtype)
