"""The engine's bf16 GEMM kernel (model/bf16_gemm.py): exact where the arithmetic is exact, within
fp32 rounding of an fp64 product otherwise, a row's bits independent of its batch, its position,
the thread count and the instruction set, and the engine's "kernel" plan on the AVX2 kind (run in a
subprocess with the math libraries capped to AVX2, as on an AVX2-only CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.model import bf16_gemm, ckernel, numerics
from pdserve.model.bf16_gemm import KernelWeight
from pdserve.model.cpu import cpu_report

AVX2 = "x86-64-v3"
SHAPES = [(37, 20), (100, 64), (1280, 96), (200, 515)]  # [N, K]: partial panels and groups, odd K
pytestmark = pytest.mark.skipif(ckernel.compiler() is None, reason="needs a C compiler")


def test_the_kernel_builds():
    assert bf16_gemm.available()


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:  # [N, K] bf16
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5).bfloat16()


@pytest.mark.parametrize("n,k", SHAPES)
def test_integer_products_are_exact(n, k):
    """Small integers sum exactly in fp32: every column lands where it belongs, tails included."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randint(-8, 9, (n, k), generator=gen).bfloat16()
    x = torch.randint(-8, 9, (13, k), generator=gen).bfloat16()
    assert torch.equal(KernelWeight(w)(x), (x.double() @ w.double().T).bfloat16())


@pytest.mark.parametrize("n,k", SHAPES)
def test_within_fp32_rounding_of_the_fp64_product(n, k):
    w, x = _weight(n, k), _weight(9, k, seed=1) * 3
    exact = x.double() @ w.double().T  # [9, N]
    bound = 2.0**-8 * exact.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)  # bf16 rounding + fp32 sums
    assert ((KernelWeight(w)(x).double() - exact).abs() <= bound).all()


def test_a_strided_row_block_gives_its_contiguous_copy():
    w = KernelWeight(_weight(100, 64))
    qkv = _weight(7, 192, seed=2)  # rows of a wider tensor: [7, 192], read [:, 64:128]
    assert torch.equal(w(qkv[:, 64:128]), w(qkv[:, 64:128].contiguous()))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_batch_position_or_threads(monkeypatch, threads):
    """The invariance contract: a row alone equals the same row in batches of 2..64 at any position,
    with the work split over 1 or 2 threads."""
    monkeypatch.setattr(bf16_gemm, "PARALLEL_WORK", 0)  # split even the smallest call
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    w = KernelWeight(_weight(1280, 96))
    samples = _weight(8, 96, seed=3) * 4  # [8, K]
    alone = torch.stack([w(samples[i:i + 1])[0] for i in range(8)])  # [8, N]
    torch.set_num_threads(threads)
    try:
        for rows in (2, 3, 5, 6, 7, 12, 13, 33, 64):
            batch = _weight(rows, 96, seed=rows) * 4
            for pos in sorted({0, 1 % rows, rows // 2, rows - 2, rows - 1}):
                placed = batch.clone()
                placed[pos] = samples[rows % 8]
                assert torch.equal(w(placed)[pos], alone[rows % 8]), (rows, pos)
    finally:
        torch.set_num_threads(before)


def test_the_avx2_scalar_and_native_builds_give_the_same_bits(monkeypatch):
    """x86-64-v3 runs the AVX2 code, baseline x86-64 the scalar fmaf loop: the same chains."""
    if not cpu_report()["features"].get("avx2"):
        pytest.skip("needs an x86 CPU with AVX2")
    w, x = _weight(200, 515), _weight(11, 515, seed=4)
    native = KernelWeight(w)(x)
    for march, vector in ((AVX2, True), ("x86-64", False)):
        monkeypatch.setattr(ckernel, "default_march", lambda march=march: march)
        assert bf16_gemm._library() is bf16_gemm._bound(march) is not None and bf16_gemm.vectorised() == vector
        assert torch.equal(KernelWeight(w)(x), native), march


def test_the_avx2_build_holds_no_avx512_code():
    objdump = shutil.which("objdump")
    if objdump is None or ckernel.load("bf16_gemm", AVX2) is None:
        pytest.skip("no objdump to read the build")
    text = subprocess.run([objdump, "-d", str(ckernel.library_path("bf16_gemm", AVX2))], capture_output=True, text=True,
                          check=True).stdout
    assert "zmm" not in text and "vfmadd231ps %ymm" in text  # 8-lane fused multiply-adds, never 16-lane


def test_the_probe_accepts_the_kernel_plan_and_bias_is_added():
    assert numerics.probe_invariance("kernel", torch.bfloat16, ((37, 20), (1280, 96))) is None
    w, x, b = _weight(37, 20), _weight(5, 20, seed=5), _weight(1, 37, seed=6)[0]
    out = numerics.linear(x, numerics.prepare(w, "kernel"), b)
    assert torch.equal(out, KernelWeight(w)(x) + b) and torch.equal(numerics.dense(numerics.prepare(w, "kernel")), w)


def test_plan_selection_prefers_the_kernel_only_without_onednn_bf16(monkeypatch):
    """The plan order, on every CPU kind: the probe is a stand-in that records what it was asked
    to try, so a kind without oneDNN bf16 packing (AVX2) is never asked to pack (the real probe
    would call mkldnn's reorder, which raises there)."""
    shapes = ((37, 20),)
    tried = []

    def probe(plan, compute, shapes, threads=0):
        tried.append(plan)
        return None if plan == tried[0] else "unreached"

    monkeypatch.setattr(numerics, "probe_invariance", probe)
    monkeypatch.setattr(numerics.onednn_packed, "available", lambda: False)
    first = "kernel" if bf16_gemm.vectorised() else "native"
    assert numerics.choose_plan(torch.bfloat16, True, shapes) == numerics.ProductPlan(first, True)
    assert tried == [first]
    tried.clear()
    assert numerics.choose_plan(torch.float32, True, shapes).plan == "tiled"
    assert tried == ["tiled"]
    fast = numerics.choose_plan(torch.bfloat16, False, shapes)  # without invariance too: it is also the faster product
    assert fast == numerics.ProductPlan("kernel" if bf16_gemm.vectorised() else "fast", False)
    monkeypatch.setattr(numerics.onednn_packed, "available", lambda: True)
    tried.clear()
    assert numerics.choose_plan(torch.bfloat16, True, shapes) == numerics.ProductPlan("native", True)
    assert tried == ["native"]  # oneDNN bf16 present: the kernel is not even probed
    assert numerics.choose_plan(torch.bfloat16, False, shapes).plan == "fast"


@pytest.mark.skipif(not numerics.onednn_packed.available(),
                    reason="this CPU has no oneDNN bf16 packing (AVX2 kind): the real probe cannot run the oneDNN plans here")
def test_with_onednn_bf16_the_real_probe_picks_a_onednn_plan():
    """Where oneDNN packs bf16 (the AVX-512 kinds), the real start-up probe settles on one of its
    plans, never the engine's own kernel."""
    plan = numerics.choose_plan(torch.bfloat16, True, ((37, 20),))
    assert plan.batch_invariant and plan.plan in ("native", "paired", "tiled")


ENGINE_CHECK = """
import torch
from pdserve.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine
from tests.engine.test_model_parity import prefill_logits
from tests.helpers.checkpoints import load_hf_model, make_random_checkpoint
ckpt = make_random_checkpoint({dir!r}, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=128, seed=1)
gen = torch.Generator().manual_seed(7)
prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 9, 16, 17, 23, 31, 40, 5, 64, 12)]
greedy = SamplingParams(max_tokens=24, ignore_eos=True)
engine = make_engine(ckpt, dtype="bfloat16")
assert engine.model.products.plan == "kernel", engine.model.products
together = [o.output_ids for o in engine.generate(prompts, greedy)]
assert [engine.generate([p], greedy)[0].output_ids for p in prompts] == together
chunked = make_engine(ckpt, dtype="bfloat16", max_num_batched_tokens=7, enable_prefix_cache=False)
assert [o.output_ids for o in chunked.generate(prompts, greedy)] == together
hf = load_hf_model(ckpt)
with torch.no_grad():
    exact = hf(torch.tensor([prompts[8]])).logits[0].float()
    torch_bf16 = hf.to(torch.bfloat16)(torch.tensor([prompts[8]])).logits[0].float()
ours = prefill_logits(engine, prompts[8])
assert (ours - exact).abs().max() <= 2 * (torch_bf16 - exact).abs().max(), ((ours - exact).abs().max(), (torch_bf16 - exact).abs().max())
engine.assert_no_leaks()
print("ok")
"""


def test_the_engine_on_the_avx2_kind_runs_the_kernel_plan_exactly(tmp_path):
    """Under the AVX2 build with oneDNN and MKL capped to AVX2 (no bf16 kernels) the engine picks
    the kernel plan; its bf16 greedy tokens are the same batched, alone and in 7-token prefill
    chunks, and its prefill logits are as close to transformers' fp32 ones as transformers' bf16."""
    if not cpu_report()["features"].get("avx2"):
        pytest.skip("needs an x86 CPU with AVX2")
    env = {**os.environ, "PDSERVE_MARCH": AVX2, "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", ENGINE_CHECK.format(dir=str(tmp_path))], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_weight_is_held_once_packed_and_unpacks_exactly():
    w = _weight(37, 20)  # a partial last panel
    kw = KernelWeight(w)
    assert "weight" not in vars(kw)  # only the packed copy of the bytes is kept
    assert torch.equal(kw.weight, w)  # rebuilt from the panels, bit for bit
    with pytest.raises(ValueError, match="is not pack\\(\\) of a weight of 60 rows"):
        bf16_gemm.bf16_linear(_weight(2, 20, seed=1), kw.packed, 60)  # would read past the panels
