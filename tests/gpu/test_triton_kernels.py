"""The GPU kernels (model/gpu/) against plain torch references, and their batch invariance: a
row's bits the same alone, among other rows, at another place in the tile grid, as a decode row
or inside a prefill chunk. Runs on a CUDA device when one is present, else on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported: in a subprocess);
skipped with the reason where Triton is not installed (CI's CPU-only image)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.model import gpu

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not gpu.triton_present(), reason="Triton is not installed (the GPU kernels' compiler)")


def run_checks(body: str) -> None:
    """Run `body` with the kernels on CUDA, or interpreted on the CPU in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]


PRELUDE = """
import torch
if not torch.cuda.is_available():  # Triton 3.6's interpreter turns a 1-element array into an int, which numpy 2.3+ refuses
    from triton.runtime import interpreter
    _patch = interpreter._patch_lang_tensor
    def _patched(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))
    interpreter._patch_lang_tensor = _patched
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gen = torch.Generator().manual_seed(0)
def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype).to(dev)
"""

ATTENTION = """
from pdserve.model.gpu.attention import paged_attention, tile_map, TILE_ROWS
B, HKV, G, D, N = 16, 2, 2, {d}, 24
dtype = torch.{dtype}
ck, cv = rnd(N, B, HKV, D, dtype=dtype), rnd(N, B, HKV, D, dtype=dtype)
perm = torch.randperm(N, generator=gen).tolist()
def reference(q, table, positions):
    keys = torch.cat([ck[b] for b in table]).double()  # [n*B, HKV, D]
    vals = torch.cat([cv[b] for b in table]).double()
    out = []
    for qi, p in zip(q.double(), positions):
        k, v = keys[:p + 1].repeat_interleave(G, 1), vals[:p + 1].repeat_interleave(G, 1)  # [p+1, HQ, D]
        w = torch.softmax(torch.einsum("hd,khd->hk", qi, k) * D ** -0.5, -1)
        out.append(torch.einsum("hk,khd->hd", w, v))
    return torch.stack(out)
table_a, table_b = perm[:9], perm[9:15]
# a step: two decode rows (positions 100 and 37), then a 40-row chunk after 50 cached keys of table_a
q = rnd(42, HKV * G, D, dtype=dtype)
tiles = tile_map([table_a, table_b], [101, 38], [(table_a, 2, 40, 90)], dev)
out = paged_attention(q, ck, cv, tiles)
ref = torch.cat([reference(q[:1], table_a, [100]), reference(q[1:2], table_b, [37]),
                 reference(q[2:], table_a, list(range(50, 90)))])
err = (out.double() - ref).norm() / ref.norm()
assert err < {tol}, err
# invariance: each chunk row alone (a one-row chunk), the chunk cut at another place, a decode row alone
for i in (0, 7, 16, 39):
    alone = paged_attention(q[2 + i:3 + i], ck, cv, tile_map([], [], [(table_a, 0, 1, 51 + i)], dev))
    assert torch.equal(alone[0], out[2 + i]), i
recut = paged_attention(q[2 + 5:], ck, cv, tile_map([], [], [(table_a, 0, 35, 90)], dev))
assert torch.equal(recut, out[7:]), (recut - out[7:]).abs().max()
for i, (table, n) in enumerate(((table_a, 101), (table_b, 38))):
    assert torch.equal(paged_attention(q[i:i + 1], ck, cv, tile_map([table], [n], [], dev))[0], out[i]), i
print("ok")
"""


@needs_triton
@pytest.mark.parametrize("dtype,d,tol", [("float32", 64, 1e-6), ("bfloat16", 64, 2e-2), ("float32", 24, 1e-6)])
def test_paged_attention_matches_a_reference_and_keeps_rows_invariant(dtype, d, tol):
    if dtype == "bfloat16" and not torch.cuda.is_available():
        pytest.skip("bf16 runs on a GPU only: Triton 3.6's CPU interpreter mis-converts fp32 -> bf16 "
                    "(p.to(bf16) @ v gives ~1e10), so its result would say nothing about the kernel")
    run_checks(ATTENTION.format(dtype=dtype, d=d, tol=tol))


GEMM_AND_NORM = """
from pdserve.model.gpu.gemm import matmul
from pdserve.model.gpu.norm import add_rms_norm
# bf16 on a GPU only: Triton 3.6's CPU interpreter mis-converts fp32 -> bf16 (values ~1e10)
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2))[:2 if dev.type == "cuda" else 1]:
    x, w, b = rnd(150, 96, dtype=dtype), rnd(200, 96, dtype=dtype), rnd(200, dtype=dtype)
    y = matmul(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    assert (y.double() - ref).norm() / ref.norm() < tol
    for i in (0, 63, 64, 149):  # a row alone, and among other row counts, keeps its bits
        assert torch.equal(matmul(x[i:i + 1], w, b)[0], y[i])
        assert torch.equal(matmul(x[i:i + 70] if i < 80 else x[i - 5:i + 1], w, b)[0 if i < 80 else 5], y[i])
    h, delta, weight = rnd(33, 96, dtype=dtype), rnd(33, 96, dtype=dtype), rnd(96, dtype=dtype)
    expect_x = h + delta
    xf = expect_x.float()
    expect = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, expect_x)
    assert (got.double() - expect.double()).abs().max() <= (2e-6 if dtype == torch.float32 else 1.6e-2) * expect.abs().max()
    assert torch.equal(add_rms_norm(h[5:6].clone(), None, weight, 1e-5)[0], add_rms_norm(h.clone(), None, weight, 1e-5)[5])
print("ok")
"""


@needs_triton
def test_gemm_and_norm_match_references_and_keep_rows_invariant():
    run_checks(GEMM_AND_NORM)
