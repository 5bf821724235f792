"""Numerics policy: batch-invariant products and the storage/compute dtype split."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.numerics import ROW_QUANTUM, linear, resolve_compute_dtype, row_quantum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 640), (640, 256), (64, 259)])
def test_linear_row_does_not_depend_on_batch_size_or_position(dtype, shape):
    k, n = shape
    gen = torch.Generator().manual_seed(k * n)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    row = torch.randn(1, k, generator=gen).to(dtype)
    quantum = row_quantum(dtype, batch_invariant=True)
    reference = linear(row, weight, quantum=quantum)[0]
    for rows in [1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 16, 31, 33, 64, 100, 257]:
        for pos in sorted({0, rows // 2, rows - 1}):
            batch = torch.randn(rows, k, generator=gen).to(dtype)
            batch[pos] = row[0]
            assert torch.equal(linear(batch, weight, quantum=quantum)[pos], reference), (rows, pos)


def test_linear_keeps_bias_and_row_count():
    x, w, b = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3)
    for quantum in (1, ROW_QUANTUM):
        out = linear(x, w, b, quantum)
        assert out.shape == (5, 3)
        torch.testing.assert_close(out, x @ w.T + b)
    assert row_quantum(torch.float32, True) == ROW_QUANTUM
    assert row_quantum(torch.float32, False) == 1 and row_quantum(torch.bfloat16, True) == 1


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
    w = mixed.model.layers[0].w13
    assert w.dtype == torch.float32 and torch.equal(w, w.bfloat16().float())
    assert torch.equal(w, pure.model.layers[0].w13.float())
    assert mixed.pool.tensor.dtype == torch.bfloat16 and mixed.abi == pure.abi
    out = mixed.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.output_ids) == 4
    mixed.assert_no_leaks()
