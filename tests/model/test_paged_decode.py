"""The in-place decode attention kernel against a plain per-row reference, and its invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import paged_decode
from pdserve.model.attention import AttnMetadata, DecodeBatch, paged_attention

pytestmark = pytest.mark.skipif(not paged_decode.available(), reason="no C compiler: the kernel is not built")

BLOCK = 16


def _setup(dtype, lens, num_kv_heads=2, group=3, head_dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lens)
    num_blocks = len(lens) * width + 5
    pool = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen).to(dtype)  # [2, N, B, H, D]
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)  # [Bd, M], padded with block 0
    for i, n in enumerate(lens):
        used = -(-n // BLOCK)
        tables[i, :used] = order[i * width:i * width + used]
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)  # [Bd, H_q, D]
    return q, pool[0], pool[1], tables, torch.tensor(lens, dtype=torch.int64)


def _reference(q, cache_k, cache_v, tables, lens):
    """fp32 SDPA per row over its own gathered keys (no padding)."""
    out = torch.empty(q.shape)
    num_kv_heads = cache_k.shape[2]
    for i, n in enumerate(lens.tolist()):
        k = cache_k[tables[i]].flatten(0, 1)[:n].float().transpose(0, 1)  # [H_kv, n, D]
        v = cache_v[tables[i]].flatten(0, 1)[:n].float().transpose(0, 1)
        qh = q[i].float().view(num_kv_heads, -1, q.shape[-1])  # [H_kv, G, D]
        out[i] = F.scaled_dot_product_attention(qh, k, v).reshape(q.shape[1:])
    return out


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 32), (3, 32), (3, 64), (2, 128), (1, 48)])
def test_matches_reference_over_ragged_lengths(pool_dtype, group, head_dim):
    lens = [1, 15, 16, 17, 100, 513]
    q, k, v, tables, ctx = _setup(pool_dtype, lens, group=group, head_dim=head_dim)
    got = paged_decode.decode_attention(q, k, v, tables, ctx)  # fp32 q: fp32 out over widened K/V
    assert got.dtype == torch.float32
    assert torch.allclose(got, _reference(q, k, v, tables, ctx), atol=2e-6, rtol=1e-5)


def test_length_one_returns_its_value_row():
    q, k, v, tables, ctx = _setup(torch.float32, [1])
    got = paged_decode.decode_attention(q, k, v, tables, ctx)  # [1, H_q, D]
    value = v[tables[0, 0], 0]  # [H_kv, D]: softmax over one key is exactly 1
    assert torch.equal(got[0].view(2, 3, -1), value.unsqueeze(1).expand(2, 3, -1))


def test_bf16_query_returns_bf16_rounded_fp32_result():
    q, k, v, tables, ctx = _setup(torch.bfloat16, [40, 70])
    qb = q.to(torch.bfloat16)
    got = paged_decode.decode_attention(qb, k, v, tables, ctx)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, paged_decode.decode_attention(qb.float(), k, v, tables, ctx).to(torch.bfloat16))


@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_scores_sum_each_pair_odd_then_even_on_every_path(head_dim):
    """Key 0's dim pairs (2p, 2p + 1): (0, A) for p < n, (eps, -A) for 16 <= p < 16 + n, zero elsewhere. A lane
    that adds its pairs in order, each pair's odd product before its even one, ends at eps (A + -A, then
    + eps); any other order loses eps (A + eps rounds to A), so q . k0 is a sum of eps or exactly 0. Key 1
    is zero and the values are +L and -L: the output L (p0 - p1) is positive only in that order. A bf16
    query's result (vdpbf16ps where the CPU has it) equals the fp32 path's bit for bit."""
    big, eps, lval, n = 256.0, 2.0 ** -16, 2.0 ** 16, min(16, head_dim // 2 - 16)
    key = torch.zeros(head_dim)
    key[1:2 * n:2] = big
    key[32:32 + 2 * n:2], key[33:33 + 2 * n:2] = eps, -big
    cache_k = torch.zeros(1, BLOCK, 1, head_dim, dtype=torch.bfloat16)
    cache_v = torch.zeros(1, BLOCK, 1, head_dim, dtype=torch.bfloat16)
    cache_k[0, 0, 0], cache_v[0, 0, 0], cache_v[0, 1, 0] = key, lval, -lval
    q = torch.ones(1, 4, head_dim, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([2])
    fp32 = paged_decode.decode_attention(q.float(), cache_k, cache_v, tables, lens)  # [1, 4, D]
    assert (fp32 > 0.1).all() and (fp32 < 2.0).all()  # 16 lanes: L tanh(n eps / sqrt(D) / 2) ~ 0.6-1
    assert torch.equal(paged_decode.decode_attention(q, cache_k, cache_v, tables, lens), fp32.bfloat16())


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_row_bits_do_not_depend_on_batch_mates_or_threads(pool_dtype):
    lens = [33, 200, 7, 512, 64, 129, 300]
    q, k, v, tables, ctx = _setup(pool_dtype, lens, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [paged_decode.decode_attention(q[i:i + 1], k, v, tables[i:i + 1, : -(-n // BLOCK)], ctx[i:i + 1])[0]
                 for i, n in enumerate(lens)]
        torch.set_num_threads(3)
        batched = paged_decode.decode_attention(q, k, v, tables, ctx)
        spread = [paged_decode.decode_attention(q[i:i + 1], k, v, tables[i:i + 1], ctx[i:i + 1])[0]
                  for i in range(len(lens))]  # one row's K/V heads over the threads
        perm = torch.tensor([6, 2, 0, 5, 1, 4, 3])
        shuffled = paged_decode.decode_attention(q[perm], k, v, tables[perm], ctx[perm])
    finally:
        torch.set_num_threads(threads)
    for i in range(len(lens)):
        assert torch.equal(batched[i], alone[i]) and torch.equal(spread[i], alone[i])
    for j, i in enumerate(perm.tolist()):
        assert torch.equal(shuffled[j], alone[i])


def test_paged_attention_routes_decode_rows_through_the_kernel():
    q, k, v, tables, ctx = _setup(torch.bfloat16, [20, 90])
    meta = AttnMetadata(slot_mapping=torch.zeros(2, dtype=torch.int64), prefills=(),
                        decode=DecodeBatch(num_rows=2, groups=(), block_tables=tables, context_lens=ctx))
    new = torch.zeros(2, 2, q.shape[-1])  # this step's K/V rows (already in the pool; unused by decode)
    got = paged_attention(q, new, new, k, v, meta)
    assert torch.equal(got, paged_decode.decode_attention(q, k, v, tables, ctx))


def test_head_dims_off_the_16_lane_grid_are_not_eligible():
    assert paged_decode.eligible(torch.zeros(2, BLOCK, 2, 64, dtype=torch.bfloat16))
    assert not paged_decode.eligible(torch.zeros(2, BLOCK, 2, 24))
    assert not paged_decode.eligible(torch.zeros(2, BLOCK, 2, 272))
    assert not paged_decode.eligible(torch.zeros(2, BLOCK, 2, 64, dtype=torch.float16))
    q, k, v, tables, ctx = _setup(torch.float32, [5], head_dim=24)
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_decode.decode_attention(q, k, v, tables, ctx)


def test_refuses_a_non_contiguous_pool():
    q, k, v, tables, ctx = _setup(torch.float32, [5])
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode.decode_attention(q, k.transpose(2, 3), v, tables, ctx)


def test_a_forked_child_runs_the_kernel_on_threads_of_its_own():
    import multiprocessing

    q, k, v, tables, ctx = _setup(torch.bfloat16, [40, 70, 9, 33])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = paged_decode.decode_attention(q, k, v, tables, ctx)  # starts the parent's helper thread
        child = multiprocessing.get_context("fork").Pool(1)
        got = child.apply_async(paged_decode.decode_attention, (q, k, v, tables, ctx)).get(timeout=120)
        child.close()
        child.join()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tp_ranks_head_slice_reads_the_strided_pool_bitwise(dtype):
    """A tensor-parallel rank reads its K/V heads as a strided view of the whole pool; its rows equal
    the whole-pool kernel's rows for those query heads bit for bit (model/tp.py's layout)."""
    q, k, v, tables, ctx = _setup(dtype, [1, 17, 40, 70, 33], num_kv_heads=4, group=3, head_dim=64)
    full = paged_decode.decode_attention(q, k, v, tables, ctx)  # [Bd, 12, D]
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)  # this rank's 2 K/V heads -> query heads 6r .. 6r + 6
        ks, vs = k[:, :, heads], v[:, :, heads]
        assert not ks.is_contiguous()
        got = paged_decode.decode_attention(q[:, 6 * rank:6 * rank + 6].contiguous(), ks, vs, tables, ctx)
        assert torch.equal(got, full[:, 6 * rank:6 * rank + 6])


def test_bf16_query_rows_are_read_in_place_at_their_stride():
    """The model's queries are a view of the fused q|k|v rows: read at that stride, bf16 in and out,
    the same bits as the contiguous fp32 query's result rounded."""
    q, k, v, tables, ctx = _setup(torch.bfloat16, [3, 40, 17], head_dim=64)
    wide = torch.randn(3, 10, 64).bfloat16()  # [Bd, H_q + 4, D]: 6 query heads, then other columns
    wide[:, :6] = q.bfloat16()
    got = paged_decode.decode_attention(wide[:, :6], k, v, tables, ctx)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, paged_decode.decode_attention(wide[:, :6].float().contiguous(), k, v, tables, ctx).bfloat16())
