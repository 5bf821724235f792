"""Products of 1-8 bf16 rows that give oneDNN's bits at a memory-bound speed (`csrc/bf16_matched.c`).

Why: a decode step of one sequence is a stream of the weights' bytes. oneDNN's bf16 kernels on an
AVX512-BF16 CPU read them at ~25 GB/s on two threads for one to four rows (the 107M checkpoint's
48 products of a step: 8.2 ms, against 5.0 ms here; one thread 14.9 against 9.0 ms; at 8 rows 17.2
against 13.0 ms, level at 12-16 rows), while the machine streams ~37 GB/s (a `sum` over 208 MB); its
one-row kernel also sums in another order than its matrix kernel, which is why the batch-invariant
"paired" plan ran single rows as four (numerics.py). This kernel streams the weights at 40+ GB/s
and reproduces oneDNN's matrix-kernel bits, so a row sent here gets the bits it gets among any
number of rows there, and batch invariance costs nothing at one row (docs/engine_speed.md §12).

How the bits are matched: oneDNN's AVX512-BF16 matrix kernel cuts the inner dimension K into
blocks (measured: 512 values for K = 768, 1024 for K = 3072); within a block each output element
is one `vdpbf16ps` chain from zero, and the block sums are added in order. The kernel does the
same with a block size `kb` that `block_for(n, k)` finds at start-up for each weight shape and
thread count: it tries every candidate on inputs built to expose the blocking (for each possible
block boundary p, a row whose products are +B = 2^20 at index 0 and -B at p, so small terms are
rounded at B's spacing in a different place when a block starts at p) plus random rows, and keeps
the one candidate whose bits equal oneDNN's matrix kernel on all of them. No candidate, or more than
one: None, and the caller keeps oneDNN (as when the kernel is not built: no AVX512-BF16, no C
compiler). The batch-invariance probe (numerics.probe_invariance) then checks the whole plan
again, a row alone against the same row among 2-65 others.

Contract: `MatchedWeight.build(w)` for a bf16 weight w [N, K] (which oneDNN also holds packed) returns a weight
whose `product(x)` for x [T, K] bf16 with 1 <= T <= ROWS_MAX returns [T, N] bf16 bit-equal to
oneDNN's packed product of x among four or more rows (rows pass over a group of 64 columns 4 at a
time, the group read from L2 after the first pass), or None where it cannot (another thread count than the one
probed, or more rows): the caller then runs oneDNN. It reads the weight in the operand layout of
`vdpbf16ps` (`pack`: groups of 64 columns, [K / 2][64][2] each). oneDNN's AVX512-BF16 blocked
layout of the same weight is byte for byte that layout (seen for every product of the 107M
checkpoint: N a multiple of 64, K of 16), so `build(w, onednn)` reads oneDNN's bytes in place when
they equal `pack(w)` (compared at load), and a weight is held once; otherwise (another layout, a
padded one, no access to oneDNN's bytes) it holds its own copy and the weight is held twice.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from pdserve.model import ckernel, onednn_packed

GROUP_COLS = 64  # output columns per packed group (csrc/bf16_matched.c)
ROWS_MAX = 8  # rows one call takes (passes of 4 rows over a group of 64 columns; level with oneDNN beyond)
PARALLEL_WORK = 1 << 18  # N * K below this runs on the calling thread (a parallel region costs ~5 us)
_B = 2.0 ** 20  # the probe's cancelling pair
_I64, _P = ctypes.c_int64, ctypes.c_void_p

_library = ckernel.Binding("bf16_matched", {
    "bf16_matched": (ctypes.c_int, [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, ctypes.c_int]),
    "bf16_matched_vector": (ctypes.c_int, []),
    "bf16_matched_openmp": (ctypes.c_int, []),
})


def available() -> bool:
    """Whether the kernel runs here: built with AVX512-BF16, and oneDNN's packed bf16 products exist."""
    lib = _library()
    return lib is not None and bool(lib.bf16_matched_vector()) and onednn_packed.available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [N, K] bf16, K even -> [ceil(N / 64), K / 2, 64, 2] bf16, zero columns padding the last group."""
    n, k = weight.shape
    pad = -n % GROUP_COLS
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, k)])
    return weight.view(-1, GROUP_COLS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack`: the plain [n, K] weight (a new tensor)."""
    groups, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(groups * GROUP_COLS, pairs * 2)[:n].contiguous()


def _threads(n: int, k: int) -> int:
    return ckernel.threads_for(n * k, PARALLEL_WORK, _library().bf16_matched_openmp)


def product(x: torch.Tensor, packed: torch.Tensor, n: int, kb: int) -> torch.Tensor:
    """x: [T, K] bf16 (1 <= T <= ROWS_MAX, rows at any stride); packed: pack(w) of w [n, K] -> [T, n] bf16."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or not 1 <= rows <= ROWS_MAX or packed.shape[1] * 2 != k:
        raise ValueError(f"matched product takes 1-{ROWS_MAX} bf16 rows of {packed.shape[1] * 2}, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=torch.bfloat16)  # [T, n]
    status = ckernel.named("pdserve::bf16_matched", _library().bf16_matched, x.data_ptr(), x.stride(0), rows, k,
                           packed.data_ptr(), n, out.data_ptr(), n, kb, _threads(n, k))
    if status:
        raise ValueError(f"bf16_matched refused rows {rows}, K {k}, block {kb} (status {status})")
    return out


def candidates(k: int) -> tuple[int, ...]:
    """Block sizes tried: K itself and every power of two from 32 below it."""
    return tuple(sorted({k} | {1 << j for j in range(5, k.bit_length()) if (1 << j) < k}))


def _probe_inputs(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [n, k], rows [R, k]) bf16, R >= 4: for every multiple p of 32 below k (every block
    boundary a candidate can have) one row whose products are +B at index 0 and -B at p (weight
    columns 0 and p are +1 and -1, the row's values there B), over random small terms; then
    random rows. A chain over one block cancels B before p and keeps the small terms' bits; a
    boundary at p rounds the small terms of both blocks at B's spacing: the two differ."""
    gen = torch.Generator().manual_seed(4321 + n * 7 + k)
    w = torch.randn(n, k, generator=gen)  # [n, k]
    bounds = list(range(32, k, 32))
    w[:, 0] = 1.0
    w[:, bounds] = -1.0
    x = torch.randn(len(bounds) + 4, k, generator=gen)  # [R, k]
    for row, p in enumerate(bounds):
        x[row, 0] = x[row, p] = _B
    return w.to(torch.bfloat16), x.to(torch.bfloat16)


def _rows(x: torch.Tensor, packed: torch.Tensor, n: int, kb: int) -> torch.Tensor:
    """The kernel over all of x's rows, ROWS_MAX at a time (and the first row alone)."""
    parts = [product(x[:1], packed, n, kb)] + [product(x[i:i + ROWS_MAX], packed, n, kb) for i in range(0, len(x), ROWS_MAX)]
    return torch.cat(parts)


def block_for(n: int, k: int, threads: int) -> int | None:
    """The one candidate block size whose bits equal oneDNN's matrix kernel on the probe
    inputs of an [n, k] weight at `threads` threads (the running count: the search runs
    there); None: none or several, another thread count, or no kernel."""
    if threads != torch.get_num_threads():
        return None
    return _block_for(n, k, threads)


@lru_cache(maxsize=256)
def _block_for(n: int, k: int, threads: int) -> int | None:
    if not available() or k % 2 or n < 1:
        return None
    w, x = _probe_inputs(n, k)
    reference = onednn_packed.PackedWeight(w)(x)  # [R, n], the matrix kernel (R >= 4 rows)
    reference = torch.cat([reference[:1], reference])
    packed = pack(w)
    found = [kb for kb in candidates(k) if torch.equal(_rows(x, packed, n, kb), reference)]
    return found[0] if len(found) == 1 else None


class MatchedWeight:
    """A weight [N, K] in the kernel's layout with the block size oneDNN's bits need; `owner`, when
    set, is the oneDNN PackedWeight whose memory `packed` reads (kept alive with it)."""

    def __init__(self, packed: torch.Tensor, n: int, kb: int, threads: int, owner: object | None = None):
        self.packed, self.n, self.kb, self.threads, self.owner = packed, n, kb, threads, owner

    @classmethod
    def build(cls, weight: torch.Tensor, onednn: onednn_packed.PackedWeight | None = None) -> MatchedWeight | None:
        """The matched weight of a bf16 weight [N, K] that oneDNN also holds packed (`onednn`: its
        bytes are read in place where they are this kernel's layout), or None where the kernel
        cannot match oneDNN's bits for its shape here."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            return None
        n, k = weight.shape
        threads = torch.get_num_threads()
        kb = block_for(n, k, threads)
        if kb is None:
            return None
        packed = pack(weight.contiguous())  # [ceil(N / 64), K / 2, 64, 2]
        shared = _same_bytes(onednn, packed) if onednn is not None else None
        return cls(packed, n, kb, threads) if shared is None else cls(shared, n, kb, threads, owner=onednn)

    @property
    def shares_onednn_bytes(self) -> bool:
        return self.owner is not None

    @property
    def weight(self) -> torch.Tensor:  # [N, K] bf16, unpacked
        return unpack(self.packed, self.n)

    def product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [T, K] bf16 -> [T, N] bf16 equal to oneDNN's matrix kernel, or None (too many rows,
        or a thread count other than the probed one, whose blocking was not checked)."""
        if not 1 <= x.shape[0] <= ROWS_MAX or torch.get_num_threads() != self.threads:
            return None
        return product(x, self.packed, self.n, self.kb)


def _same_bytes(onednn: onednn_packed.PackedWeight, packed: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's bytes viewed as `packed`'s shape where they are bit for bit `packed`, else None."""
    raw = onednn.raw()
    if raw is None or raw.numel() != packed.numel():
        return None
    raw = raw.view(packed.shape)
    return raw if torch.equal(raw.view(torch.int16), packed.view(torch.int16)) else None
