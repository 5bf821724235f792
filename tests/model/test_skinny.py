"""The skinny small-batch fp32 product: same values as torch up to rounding, used only where
batch invariance is off, and a decode with it matches the GEMM path's tokens and logits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.model import skinny
from pdserve.model.numerics import linear


def test_numba_is_installed():
    assert skinny.AVAILABLE, "numba is a dependency: the skinny kernel must be importable"


@pytest.mark.parametrize("shape", [(256, 640), (640, 256), (64, 259), (1024, 1536), (5, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_torch_for_every_row_count(shape, with_bias):
    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    weight = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen) if with_bias else None
    for rows in range(1, skinny.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=gen)
        got = skinny.skinny_linear(x, weight, bias)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_linear_routes_only_small_fp32_products_through_the_kernel(monkeypatch):
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(16, 8)
    for rows in (1, 2, 8, 9, 64):
        linear(torch.randn(rows, 8), w, skinny_rows=True)
    linear(torch.randn(4, 8), w, skinny_rows=False)
    assert calls == [2, 8]
    with pytest.raises(TypeError):
        real(torch.randn(2, 8).bfloat16(), w.bfloat16())


def test_eligibility():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert skinny.eligible(torch.float32, batch_invariant=False)
        assert not skinny.eligible(torch.float32, batch_invariant=True)
        assert not skinny.eligible(torch.bfloat16, batch_invariant=False)
        torch.set_num_threads(2)
        assert not skinny.eligible(torch.float32, batch_invariant=False)
    finally:
        torch.set_num_threads(threads)


def test_decode_with_skinny_products_matches_the_gemm_path(tmp_path):
    """Four sequences decoding together: greedy tokens equal the batch-invariant (GEMM) engine's,
    and the skinny engine really took the kernel path."""
    from tests.helpers.checkpoints import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=64, seed=9)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    for invariant in (True, False):
        engine = Engine(EngineConfig(model=str(ckpt), dtype="float32", batch_invariant=invariant, num_blocks=32,
                                     num_threads=1))
        assert engine.model.skinny is (not invariant)
        outputs[invariant] = [o.output_ids for o in engine.generate(prompts, params)]
        engine.assert_no_leaks()
    assert outputs[False] == outputs[True]


def test_numba_is_loaded_only_by_an_engine_that_runs_the_kernel():
    """A bf16, batch-invariant engine (the served default) never imports numba; an fp32 one without
    invariance on one thread compiles the kernel at load."""
    code = ("import sys, torch; torch.set_num_threads(1); from pdserve.engine.config import EngineConfig; "
            "from pdserve.engine.engine import Engine; "
            "e = Engine(EngineConfig(model='tiny', kv_cache_bytes=16 << 20, dtype=sys.argv[1], batch_invariant=sys.argv[2] == '1')); "
            "print(e.model.skinny, 'numba' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {args: subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                                 timeout=300, check=True).stdout.split() for args in (("bfloat16", "1"), ("float32", "0"))}
    assert runs == {("bfloat16", "1"): ["False", "False"], ("float32", "0"): ["True", "True"]}
