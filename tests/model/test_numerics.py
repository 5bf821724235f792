"""Numerics policy: batch-invariant products and the storage/compute dtype split."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.model import numerics
from pdserve.model.numerics import (
    TILE_COLS, BatchInvarianceError, ProductPlan, TiledWeight, choose_plan, dense, linear, prepare, resolve_compute_dtype,
)


SHAPES = [(256, 640), (640, 256), (64, 259), (1024, 259)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 16, 31, 32, 33, 64, 100, 257]


def assert_rows_invariant(dtype: torch.dtype, k: int, n: int) -> None:
    """One row gives the same bits alone and at the first, middle and last place of every batch."""
    plan = choose_plan(dtype, True, ((n, k),)).plan
    gen = torch.Generator().manual_seed(k * n)
    weight = prepare((torch.randn(n, k, generator=gen) / k**0.5).to(dtype), plan)
    row = torch.randn(1, k, generator=gen).to(dtype)
    reference = linear(row, weight)[0]
    for rows in ROWS:
        for pos in sorted({0, rows // 2, rows - 1}):
            batch = torch.randn(rows, k, generator=gen).to(dtype)
            batch[pos] = row[0]
            assert torch.equal(linear(batch, weight)[pos], reference), (plan, rows, pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_row_does_not_depend_on_batch_size_or_position(dtype, shape):
    assert_rows_invariant(dtype, *shape)


def test_fp32_products_are_tiled_by_construction():
    """fp32 never trusts the BLAS's per-shape kernel choice: every call has one fixed shape."""
    plan = choose_plan(torch.float32, True, ((640, 256),))
    assert plan == ProductPlan("tiled", True) and "tiled 32x512" in plan.describe()
    w = prepare(torch.randn(1100, 64), "tiled")
    assert isinstance(w, TiledWeight) and w.cols == TILE_COLS and len(w.blocks) == 3  # 1100 -> 3 x 512
    small = prepare(torch.randn(259, 64), "tiled")
    assert small.cols == 259 and len(small.blocks) == 1
    assert choose_plan(torch.float32, False, ((640, 256),)) == ProductPlan("fast", False)


def _isa_capped_check(env: dict[str, str]) -> None:
    code = ("import torch; from tests.model.test_numerics import assert_rows_invariant as a\n"
            "for dt in (torch.float32, torch.bfloat16):\n    a(dt, 256, 640); a(dt, 1024, 259)\nprint('ok')")
    full = {**os.environ, **env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("caps", [
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
])
def test_invariance_holds_on_other_kernel_paths(caps):
    """The same checks with the math libraries capped to older instruction sets: on an AVX-512
    machine the AVX2 row is the other CPU kind's code path; on AVX2 the SSE row is one more."""
    _isa_capped_check(caps)


def test_a_failed_probe_refuses_batch_invariant_mode(monkeypatch):
    """Where no plan keeps rows invariant the engine refuses to start, naming the way out."""
    monkeypatch.setattr(numerics, "probe_invariance", lambda plan, dtype, shapes, threads=0: f"{plan} broke")
    with pytest.raises(BatchInvarianceError, match="native: native broke; paired: paired broke; tiled: tiled broke.*--no-batch-invariant"):
        choose_plan(torch.bfloat16, True, ((8, 8),))
    monkeypatch.setattr(numerics.onednn_packed, "available", lambda: True)  # the AVX2 kind picks the kernel instead
    assert choose_plan(torch.bfloat16, False, ((8, 8),)).plan == "fast"


def test_linear_keeps_bias_and_row_count():
    x, w, b = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3)
    for plan in ("tiled", "native", "paired"):
        out = linear(x, prepare(w, plan), b)
        assert out.shape == (5, 3)
        torch.testing.assert_close(out, x @ w.T + b)
    x = torch.randn(70, 96)
    w = torch.randn(1030, 96)
    torch.testing.assert_close(linear(x, prepare(w, "tiled")), x @ w.T, rtol=1e-5, atol=1e-4)


def test_resolve_compute_dtype():
    assert resolve_compute_dtype("bfloat16") == torch.bfloat16
    assert resolve_compute_dtype("bfloat16", "float32") == torch.float32
    assert resolve_compute_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        resolve_compute_dtype("float16")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_compute_dtype("bfloat16", "int8")


def test_fp32_compute_over_bf16_storage_rounds_weights_and_kv(tmp_path):
    """Weights are exact bf16 values held in fp32; the pool holds bf16; the ABI (what a handoff
    moves) is the storage dtype's."""
    from tests.helpers.checkpoints import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=64, seed=5)
    mixed = Engine(EngineConfig(model=str(ckpt), dtype="bfloat16", compute_dtype="float32", num_blocks=16))
    pure = Engine(EngineConfig(model=str(ckpt), dtype="bfloat16", num_blocks=16))
    w = dense(mixed.model.layers[0].w13)
    assert w.dtype == torch.float32 and torch.equal(w, w.bfloat16().float())
    assert torch.equal(w, dense(pure.model.layers[0].w13).float())
    assert mixed.pool.tensor.dtype == torch.bfloat16 and mixed.abi == pure.abi
    out = mixed.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.output_ids) == 4
    mixed.assert_no_leaks()
