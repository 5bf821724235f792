"""The C kernels built for AVX2 only (x86-64-v3, as an AVX2-only machine's `-march=native` build
has no AVX-512) compute what the native build computes, checked on whatever machine runs the
suite: the same inputs run once more with the modules' build switched to x86-64-v3 (they ask
ckernel.default_march() at each call)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from pdserve.model import ckernel, glue, paged_decode, paged_prefill
from pdserve.model.cpu import cpu_report
from pdserve.model.llama import rotary_sin

AVX2 = "x86-64-v3"
pytestmark = pytest.mark.skipif(not (cpu_report()["features"]["avx2"] and paged_decode.available()),
                                reason="needs an x86 CPU with AVX2 and a C compiler")

def run_all() -> dict[str, torch.Tensor]:
    """Every kernel on fixed inputs (bf16 pools, GQA 3, D = 64)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 24, 16, 4, 64, generator=gen).bfloat16()  # [2, N, B, H_kv, D]
    tables = torch.randperm(24, generator=gen)[:20].view(2, 10)  # [2, 10]
    q = torch.randn(2, 12, 64, generator=gen)
    decode = paged_decode.decode_attention(q, pool[0], pool[1], tables, torch.tensor([150, 37]))
    qp = torch.randn(60, 12, 64, generator=gen).bfloat16()
    prefill = paged_prefill.prefill_attention(qp.float(), pool[0], pool[1], tables[0], 150)
    x, delta = torch.randn(5, 768, generator=gen), torch.randn(5, 768, generator=gen)
    norm = glue.add_rms_norm(x, delta, torch.rand(768, generator=gen) + 0.5, 1e-5)
    qkv = torch.randn(5, 20 * 64, generator=gen).bfloat16()
    cos, sin = torch.randn(50, 64, generator=gen).bfloat16(), rotary_sin(torch.randn(50, 64, generator=gen)).bfloat16()
    glue.rope_(qkv, 16, 64, torch.tensor([0, 3, 9, 27, 49]), cos, sin)
    silu = glue.silu_mul(3 * torch.randn(5, 2 * 384, generator=gen))
    return {"decode": decode, "prefill": prefill, "residual": x, "norm": norm, "rope": qkv, "silu": silu}


def test_an_avx2_build_computes_what_the_native_build_does(monkeypatch):
    native = run_all()
    monkeypatch.setattr(ckernel, "default_march", lambda: AVX2)
    assert paged_decode._library() is paged_decode._bound(AVX2) is not paged_decode._bound("native")
    avx2 = run_all()
    # the glue rounds every operation as written: the same bits on either instruction set
    for name in ("residual", "norm", "rope", "silu"):
        assert torch.equal(avx2[name], native[name]), name
    # the attention kernels use fast-math (vector expf from libmvec, per-width): within fp32 rounding
    for name in ("decode", "prefill"):
        torch.testing.assert_close(avx2[name], native[name], rtol=0, atol=2e-6)


def test_the_avx2_build_has_no_avx512_instructions():
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the build")
    for name in ("paged_decode", "paged_prefill", "glue"):
        assert ckernel.load(name, AVX2) is not None
        text = subprocess.run([objdump, "-d", str(ckernel.library_path(name, AVX2))], capture_output=True,
                              text=True, check=True).stdout
        assert "zmm" not in text and "ymm" in text, name  # 256-bit AVX2 vectors, never 512-bit
