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
- Batch invariance (`EngineConfig.batch_invariant`, on by default): a row's result never depends
  on how many rows share its product or where it sits among them. A BLAS picks its kernel, and
  with it the summation order, from the product's shape (MKL on AVX-512 uses other fp32 kernels
  for 4 rows than for 12), so invariance cannot rest on a library's per-shape choice. The
  "tiled" plan holds it by construction: every product is cut into calls of one fixed shape,
  TILE_ROWS rows (the last tile zero-padded) by one fixed column block of the weight, so every
  row of every step goes through the same kernel call shape, and a GEMM call sums each output
  element over the inner dimension alike for all of its rows. With MKL the column blocks are
  packed once at load (`_mkl_linear`), which keeps a block in cache across row tiles.
  fp32 uses it always. Where oneDNN has no bf16 kernels (AVX2 CPUs), bf16 runs the "kernel" plan
  first: bf16_gemm.py's products, one fixed fma chain per output element by construction.
  Otherwise bf16 keeps PyTorch's own products ("native": on AVX2 an fp32-accumulating
  loop per output element, on AVX512-BF16/AMX oneDNN), which a start-up probe must find
  invariant; failing that, "paired" (the same products, ones of fewer rows run as ONE_ROW_AS rows, since
  a BLAS's one-row kernel is often the only one whose sums differ); failing that bf16 moves to
  tiles too, and if that fails the engine refuses
  to start in batch-invariant mode (`BatchInvarianceError`) rather than run silently inexact.
  On AVX512-BF16 builds, under any plan that keeps oneDNN's products, 1-8 rows without a bias run
  matched_gemv.py's kernel, which reproduces oneDNN's matrix-kernel bits (its blocking found and
  checked at start-up) at memory speed, so neither the one-row kernel nor the padding is used there
  (the probe then finds "native" invariant); where it cannot match a shape, or the thread count
  changed since load, rows fall back to oneDNN padded to ONE_ROW_AS.
- On a CUDA device: "triton" (invariant: model/gpu/gemm.py, one fixed tiling whatever the row
  count) or, without invariance, "cublas" (torch's products, the faster default on a GPU).
- Without batch invariance ("fast"), fp32 on one thread, products of 2-8 rows go through skinny.py's
  kernel (one pass over the weights instead of MKL's small-row GEMM, which reads them per row);
  on the AVX2 kind bf16 products keep the "kernel" plan (the faster product there too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from pdserve.model import bf16_gemm, onednn_packed, skinny
from pdserve.model.bf16_gemm import KernelWeight
from pdserve.model.matched_gemv import ROWS_MAX, MatchedWeight
from pdserve.model.onednn_packed import PackedWeight

TILE_ROWS = 32  # rows of every tiled product call (decode batches up to 32 cost one call)
TILE_COLS = 512  # weight rows (output columns) per call: a [512, K] fp32 block stays in L2
# Rows a "paired" product of fewer rows runs as: oneDNN's bf16 products (AVX512-BF16 EPYC, 107M shapes,
# one thread, CPU time) took 26.0 ms for a decode step's 48 products at 2 rows, 22.8 at 4, 24.0 at 1;
# 2 and 3 rows padded to 4 (engine decode step, 1 thread): batch 2 33.0 -> 27.9 ms, batch 3 27.5 -> 26.5
ONE_ROW_AS = 4
COMPUTE_CHOICES = ("float32", "bfloat16")
PLANS = ("tiled", "native", "paired", "kernel", "fast", "triton", "cublas")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class BatchInvarianceError(RuntimeError):
    """Batch-invariant products cannot be had on this machine with this dtype."""


def resolve_compute_dtype(storage: str, requested: str | None = None) -> torch.dtype:
    """(storage dtype name, None | dtype name) -> the torch dtype activations and matmuls use."""
    for name in (storage, requested or storage):
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected one of {COMPUTE_CHOICES}")
    return _DTYPES[requested or storage]


@lru_cache(maxsize=1)
def mkl_packed_available() -> bool:
    """Whether this torch build has MKL's packed-weight linear (x86 builds with MKL)."""
    try:
        w = torch.ones(2, 3)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
        return bool(torch.ops.mkl._mkl_linear(torch.ones(1, 3), packed, w, None, 1).eq(3).all())
    except (AttributeError, RuntimeError):
        return False


class TiledWeight:
    """A weight [N, K] whose products run as calls of one fixed shape [TILE_ROWS, K] x [K, cols]."""

    def __init__(self, weight: torch.Tensor):  # weight: [N, K]
        n, k = weight.shape
        self.weight = weight
        self.dtype = weight.dtype
        self.cols = min(TILE_COLS, n)
        padded = -(-n // self.cols) * self.cols
        if padded != n:
            weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
        self.packed = mkl_packed_available() and weight.dtype == torch.float32
        # `_mkl_linear` reads only the shape of its third argument when the row count matches
        self._shape = weight.new_zeros(()).expand(self.cols, k)
        self.blocks = [self._prepare(weight[j:j + self.cols].contiguous()) for j in range(0, padded, self.cols)]

    def _prepare(self, block: torch.Tensor) -> torch.Tensor:  # block: [cols, K]
        return torch.ops.mkl._mkl_reorder_linear_weight(block, TILE_ROWS) if self.packed else block

    def _call(self, x: torch.Tensor, block: torch.Tensor) -> torch.Tensor:  # [TILE_ROWS, K] -> [TILE_ROWS, cols]
        if self.packed:
            return torch.ops.mkl._mkl_linear(x, block, self._shape, None, TILE_ROWS)
        return torch.mm(x, block.t())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] -> [T, N]."""
        rows, n = x.shape[0], self.weight.shape[0]
        pad = -rows % TILE_ROWS
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        out = x.new_empty(rows + pad, len(self.blocks) * self.cols)  # [T', N']
        tiles = [x[i:i + TILE_ROWS] for i in range(0, rows + pad, TILE_ROWS)]
        for b, block in enumerate(self.blocks):  # block outer: it stays in cache across row tiles
            c0 = b * self.cols
            for t, tile in enumerate(tiles):
                out[t * TILE_ROWS:(t + 1) * TILE_ROWS, c0:c0 + self.cols] = self._call(tile, block)
        return out[:rows, :n]


class PairedWeight:
    """A bf16 weight [N, K] whose products of few rows avoid oneDNN's matrix-vector kernel, which
    sums in another order than its matrix kernel (x86 bf16: about one row in twelve rounds
    differently) and streams the weights slower. 1-8 rows without a bias go through
    matched_gemv's kernel where it reproduces the matrix kernel's bits on this machine
    (`matched`); otherwise fewer than ONE_ROW_AS rows run as ONE_ROW_AS (the first row repeated
    after them), a bias added by oneDNN with the product (one rounding, as F.linear). In the
    matrix kernel a row's bits do not depend on its batch mates (the probe checks both on each
    machine); 2 and 3 rows are padded too because oneDNN's few-row kernels are slower than its
    4-row one here (ONE_ROW_AS)."""

    def __init__(self, inner: torch.Tensor | PackedWeight, matched: MatchedWeight | None = None):
        self.inner, self.matched = inner, matched  # inner: [N, K], plain or oneDNN-packed

    @property
    def weight(self) -> torch.Tensor:  # [N, K]
        return dense(self.inner)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, K] -> [T, N]; bias: [N] or None."""
        rows, k = x.shape
        if bias is None and self.matched is not None and 0 < rows <= ROWS_MAX:
            out = self.matched.product(x)
            if out is not None:
                return out
        if rows >= ONE_ROW_AS or rows == 0:  # no rows: nothing to pad with
            return _product(x, self.inner, bias)
        if rows == 1:
            return _product(x.expand(ONE_ROW_AS, k), self.inner, bias)[:1]  # the row repeated: one copy, no zeros
        return _product(torch.cat([x, x[:1].expand(ONE_ROW_AS - rows, k)]), self.inner, bias)[:rows]  # [ONE_ROW_AS, K]


def _product(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return weight(x, bias) if isinstance(weight, PackedWeight) else F.linear(x, weight, bias)


Weight = torch.Tensor | TiledWeight | PairedWeight | PackedWeight | KernelWeight


def prepare(weight: torch.Tensor, plan: str) -> Weight:
    """A weight [N, K] made ready for `linear` under `plan` ("tiled" packs it into tiles; the
    others keep torch's products, with a bf16 weight reordered once for oneDNN (onednn_packed:
    the same bits as F.linear, without a reorder per call), and "paired" wraps that, as does every
    plan where matched_gemv's kernel reproduces oneDNN's bits for this shape: 1-8 rows run there)."""
    if plan == "tiled":
        return TiledWeight(weight)
    if plan == "kernel":
        return KernelWeight(weight)
    if plan == "triton":
        from pdserve.model.gpu.gemm import GemmWeight  # Triton: imported only where a GPU plan runs
        return GemmWeight(weight)
    if plan == "cublas":
        return weight.contiguous()
    base = onednn_packed.pack(weight)
    matched = MatchedWeight.build(weight, base) if isinstance(base, PackedWeight) else None  # reads base's bytes where it can
    if plan == "paired" or matched is not None:  # few rows: the matched kernel, else (paired) padded
        return PairedWeight(base, matched)
    return base


def dense(weight: Weight) -> torch.Tensor:
    """The plain [N, K] tensor behind a prepared weight."""
    return getattr(weight, "weight", weight) if not isinstance(weight, torch.Tensor) else weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, skinny_rows: bool = False) -> torch.Tensor:
    """x: [T, in] -> [T, out]. A TiledWeight runs fixed-shape calls; with `skinny_rows` (see
    skinny.eligible) 2-8 rows go through the skinny kernel; otherwise one F.linear."""
    if isinstance(weight, (PackedWeight, PairedWeight)) or not isinstance(weight, (torch.Tensor, TiledWeight, KernelWeight)):
        return weight(x, bias)  # packed, paired, or the GPU's GemmWeight
    if isinstance(weight, (TiledWeight, KernelWeight)):
        out = weight(x)
        return out if bias is None else out + bias
    if skinny_rows and skinny.applies(x):
        return skinny.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class ProductPlan:
    """How a model's products run: `plan` in PLANS and whether rows are batch-invariant."""

    plan: str
    batch_invariant: bool
    matched: tuple[int, int] = (0, 0)  # (weights whose 1-8 row products run matched_gemv's kernel, weights)

    def with_weights(self, weights: list[Weight]) -> ProductPlan:
        """This plan, noting how many of a model's prepared `weights` run few rows matched."""
        used = sum(isinstance(w, PairedWeight) and w.matched is not None for w in weights)
        return replace(self, matched=(used, len(weights)))

    def describe(self) -> str:
        used, total = self.matched
        note = f"; 1-{ROWS_MAX} rows through the matched kernel (oneDNN's bits) in {used} of {total} weights" if used else ""
        return self._plan_text() + note

    def _plan_text(self) -> str:
        if self.plan == "tiled":
            packing = "mkl-packed" if mkl_packed_available() else "torch.mm"
            return f"tiled {TILE_ROWS}x{TILE_COLS} ({packing})"
        return {"native": "native (probed invariant)", "paired": f"native, products of 1-{ONE_ROW_AS - 1} rows as {ONE_ROW_AS} rows (probed invariant)",
                "kernel": "bf16_gemm kernel (one fma chain per element)",
                "fast": "fast (not batch-invariant)",
                "triton": "triton GEMM, one fixed tiling (batch-invariant by construction)",
                "cublas": "cuBLAS (not batch-invariant)"}[self.plan]


def choose_plan(compute: torch.dtype, batch_invariant: bool, shapes: tuple[tuple[int, int], ...],
                device: str = "cpu") -> ProductPlan:
    """The product plan for a model whose weights have these [N, K] shapes; raises
    BatchInvarianceError when invariance was asked for and no plan passes the probe."""
    if device != "cpu":  # the GPU plans: invariant by construction, no probe of a library's choices
        return ProductPlan("triton" if batch_invariant else "cublas", batch_invariant)
    # no oneDNN bf16 (AVX2 kind): torch re-reads the weights for every row, the kernel does not
    kernel_first = compute == torch.bfloat16 and not onednn_packed.available() and bf16_gemm.vectorised()
    if not batch_invariant:
        return ProductPlan("kernel" if kernel_first else "fast", False)
    candidates = ("native", "paired", "tiled") if compute == torch.bfloat16 else ("tiled",)
    if kernel_first:
        candidates = ("kernel",) + candidates
    failures = []
    for plan in candidates:
        bad = probe_invariance(plan, compute, shapes, torch.get_num_threads())
        if bad is None:
            return ProductPlan(plan, True)
        failures.append(f"{plan}: {bad}")
    raise BatchInvarianceError(
        f"batch-invariant {str(compute).removeprefix('torch.')} products failed the start-up probe on this CPU "
        f"({'; '.join(failures)}); start with --no-batch-invariant to serve without the guarantee")


PROBE_ROWS = (2, 3, 5, 9, 13, 33, 65, 512)  # batch sizes the probe places its rows in (512: a prefill chunk)
PROBE_SAMPLES = 32  # distinct rows per weight shape


@lru_cache(maxsize=64)
def probe_invariance(plan: str, compute: torch.dtype, shapes: tuple[tuple[int, int], ...], threads: int = 0) -> str | None:
    """None when, for every weight shape, each of PROBE_SAMPLES random rows gives the same bits
    alone (a one-row product) and placed among other rows in batches of PROBE_ROWS rows; else
    the first failure. Many rows, because a kernel that differs between one row and many (a
    BLAS's matrix-vector path) differs only for some inputs: one bf16 row in ~12 rounds
    otherwise, so a single sampled row lets a non-invariant plan pass most of the time.
    `threads` only keys the cache: few rows run matched_gemv's kernel as checked at the thread
    count of the load, so another count is probed afresh."""
    gen = torch.Generator().manual_seed(1234)
    for n, k in sorted(set(shapes)):
        weight = prepare((torch.randn(n, k, generator=gen) / k**0.5).to(compute), plan)
        samples = torch.randn(PROBE_SAMPLES, k, generator=gen).to(compute)  # [S, K]
        alone = torch.stack([linear(samples[i:i + 1], weight)[0] for i in range(PROBE_SAMPLES)])  # [S, N]
        for rows in PROBE_ROWS:
            batch = torch.randn(rows, k, generator=gen).to(compute)  # [rows, K]
            for first in range(0, PROBE_SAMPLES, rows):
                placed = batch.clone()
                count = min(rows, PROBE_SAMPLES - first)
                at = torch.arange(count) * rows // count  # spread over the batch: first, middle, last
                placed[at] = samples[first:first + count]
                if not torch.equal(linear(placed, weight)[at], alone[first:first + count]):
                    return f"weight {n}x{k}, a row alone vs among {rows}"
    return None
