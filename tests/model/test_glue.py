"""The C glue (residual add + RMSNorm, RoPE) against the eager formulas, and its row invariance."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import glue
from pdserve.model.llama import apply_rope, rotary_sin

pytestmark = pytest.mark.skipif(not glue.available(), reason="no C compiler: the glue is not built")

DTYPES = [torch.float32, torch.bfloat16]


def _rows(dtype, rows=70, d=768, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(rows, d, generator=gen).to(dtype) for _ in range(2))
    return x, delta, (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_is_torchs_add_and_the_norm_is_transformers_within_a_bit(dtype):
    x, delta, w = _rows(dtype)
    expected_x = x + delta
    expected = glue.rms_norm_eager(expected_x, w, 1e-5)
    got = glue.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, expected_x)  # the residual stream, updated in place
    assert got.dtype == dtype
    # only the sum of squares' order differs: the fp32 scale by an ulp or so. torch's own order
    # depends on its vector width (AVX2 vs AVX-512), so in bf16 that ulp may flip a rare rounding tie
    # on another CPU kind: at most 1 element in 10^4, by one bf16 ulp (on this sample, here: none)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        assert (got != expected).float().mean() < 1e-4
        torch.testing.assert_close(got.float(), expected.float(), rtol=1 / 128, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_norm_does_not_depend_on_batch_mates_or_threads(dtype):
    x, _, w = _rows(dtype, rows=130)
    alone = torch.cat([glue.add_rms_norm(x[i:i + 1].clone(), None, w, 1e-6) for i in range(130)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(glue.add_rms_norm(x.clone(), None, w, 1e-6), alone)  # 130 rows: the parallel path
            perm = torch.randperm(130)
            assert torch.equal(glue.add_rms_norm(x[perm].contiguous(), None, w, 1e-6), alone[perm])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 100])
def test_rope_is_bit_for_bit_the_eager_rotation(dtype, rows):
    gen = torch.Generator().manual_seed(1)
    cos = torch.randn(300, 64, generator=gen).to(dtype)
    sin = rotary_sin(torch.randn(300, 64, generator=gen)).to(dtype)
    qkv = torch.randn(rows, 20 * 64, generator=gen).to(dtype)  # 12 query + 4 key heads rotated, 4 value heads not
    pos = torch.randint(0, 300, (rows,), generator=gen)
    expected = apply_rope(qkv[:, :16 * 64].view(rows, 16, 64), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    got = qkv.clone()
    assert glue.rope_(got, 16, 64, pos, cos, sin)
    assert torch.equal(got[:, :16 * 64].view(rows, 16, 64), expected)
    assert torch.equal(got[:, 16 * 64:], qkv[:, 16 * 64:])


def test_rope_declines_tensors_it_cannot_take():
    cos = torch.randn(10, 64)
    qkv = torch.randn(3, 4 * 64)
    assert not glue.rope_(qkv, 2, 64, torch.zeros(3, dtype=torch.int64), cos, cos.bfloat16())
    assert not glue.rope_(qkv.t(), 2, 64, torch.zeros(3, dtype=torch.int64), cos, cos)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_eager_formula_within_its_exp(dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(130, 2 * 384, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, -88.0, 90.0, 0.0])  # the clamps and zero
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = glue.silu_mul(gate_up)
    assert got.shape == (130, 384) and got.dtype == dtype
    if dtype == torch.bfloat16:  # rounding to bf16 hides an ulp of fp32 but for the rare tie: allow 1 in 10^4
        assert (got != expected).float().mean() < 1e-4
        torch.testing.assert_close(got.float(), expected.float(), rtol=1 / 128, atol=1e-30)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-30)
    assert torch.equal(glue.silu_mul(gate_up[5:6].contiguous()), got[5:6])  # a row alone: the same bits


def test_silu_mul_rows_do_not_depend_on_batch_mates_or_threads():
    """Calls of at least PARALLEL_ELEMENTS values split their rows over the OpenMP threads (16 rows of a
    3072-wide SiLU * up already): each row's bits are its bits alone, on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(4)
    gate_up = (3 * torch.randn(40, 2 * 3072, generator=gen)).to(torch.bfloat16)
    assert 16 * 3072 >= glue.PARALLEL_ELEMENTS
    alone = torch.cat([glue.silu_mul(gate_up[i:i + 1].contiguous()) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (16, 33, 40):
                assert torch.equal(glue.silu_mul(gate_up[:rows].contiguous()), alone[:rows])
    finally:
        torch.set_num_threads(threads)
