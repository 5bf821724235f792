"""The causal prefill attention kernel against fp32 SDPA, and its invariance to chunking and threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import paged_prefill

pytestmark = pytest.mark.skipif(not paged_prefill.available(), reason="no C compiler: the kernel is not built")

BLOCK = 16


def _pool(dtype, ctx, num_kv_heads=2, head_dim=64, seed=0):
    """A shuffled block table over a pool with spare blocks: ([2, N, B, H, D] pool, [M] table)."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-ctx // BLOCK)
    pool = torch.randn(2, used + 7, BLOCK, num_kv_heads, head_dim, generator=gen).to(dtype)
    return pool, torch.randperm(used + 7, generator=gen)[:used]


def _reference(q, pool, table, ctx):
    """fp32 causal SDPA of q [S, H_q, D] (rows at ctx - S .. ctx - 1) over the gathered keys."""
    k = pool[0][table].flatten(0, 1)[:ctx].float().transpose(0, 1)  # [H_kv, ctx, D]
    v = pool[1][table].flatten(0, 1)[:ctx].float().transpose(0, 1)
    s = q.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - s, ctx)[:, None]  # [S, ctx]
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
    return o.transpose(0, 1)  # [S, H_q, D]


@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (48, 1), (256, 4)])
@pytest.mark.parametrize("q_len,ctx", [(1, 1), (37, 37), (16, 50), (100, 300)])
def test_matches_fp32_sdpa(head_dim, group, q_len, ctx):
    pool, table = _pool(torch.float32, ctx, head_dim=head_dim)
    q = torch.randn(q_len, 2 * group, head_dim, generator=torch.Generator().manual_seed(1))
    got = paged_prefill.prefill_attention(q, pool[0], pool[1], table, ctx)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(q, pool, table, ctx), rtol=0, atol=2e-6)


def test_bf16_is_the_fp32_result_over_widened_values_rounded():
    pool, table = _pool(torch.bfloat16, 70)
    q = torch.randn(70, 6, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = paged_prefill.prefill_attention(q, pool[0], pool[1], table, 70)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, paged_prefill.prefill_attention(q.float(), pool[0], pool[1], table, 70).bfloat16())
    torch.testing.assert_close(got.float(), _reference(q, pool, table, 70), rtol=0, atol=1e-2)


@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (48, 1)])
def test_a_strided_bf16_query_scores_as_its_fp32_copy(head_dim, group):
    """The query heads read in place from q|k|v rows (bf16 dot products on AVX512-BF16) give the bits
    of the contiguous fp32 query: the same pair order on both paths, chunk after cached context too."""
    pool, table = _pool(torch.bfloat16, 300, head_dim=head_dim)
    qkv = torch.randn(100, (2 * group + 4) * head_dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    q = qkv[:, :2 * group * head_dim].view(100, 2 * group, head_dim)  # row stride > H_q * D
    got = paged_prefill.prefill_attention(q, pool[0], pool[1], table, 300)
    assert torch.equal(got, paged_prefill.prefill_attention(q.float().contiguous(), pool[0], pool[1], table, 300).bfloat16())
    torch.testing.assert_close(got.float(), _reference(q, pool, table, 300), rtol=0, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_chunking_or_threads(dtype):
    """Whole prompt vs cut into chunks of 1, 7, 16 and 50 rows (each after the earlier rows' K/V), on 1
    and 2 threads: every row bit for bit the same."""
    ctx = 131
    pool, table = _pool(dtype, ctx, num_kv_heads=4)
    q = torch.randn(ctx, 12, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole = paged_prefill.prefill_attention(q, pool[0], pool[1], table, ctx)
    threads = torch.get_num_threads()
    try:
        for n_threads, chunk in ((1, 1), (2, 7), (1, 16), (2, 50), (1, ctx)):
            torch.set_num_threads(n_threads)
            parts = [paged_prefill.prefill_attention(q[s:s + chunk], pool[0], pool[1], table, min(s + chunk, ctx))
                     for s in range(0, ctx, chunk)]
            assert torch.equal(torch.cat(parts), whole), (n_threads, chunk)
    finally:
        torch.set_num_threads(threads)


def test_a_tp_ranks_head_slice_reads_the_strided_pool_bitwise():
    pool, table = _pool(torch.bfloat16, 90, num_kv_heads=4)
    q = torch.randn(40, 12, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = paged_prefill.prefill_attention(q, pool[0], pool[1], table, 90)
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)
        got = paged_prefill.prefill_attention(q[:, 6 * rank:6 * rank + 6], pool[0][:, :, heads],
                                              pool[1][:, :, heads], table, 90)
        assert torch.equal(got, full[:, 6 * rank:6 * rank + 6])


def test_refuses_a_chunk_past_its_table():
    pool, table = _pool(torch.float32, 20)
    with pytest.raises(ValueError, match="cannot end"):
        paged_prefill.prefill_attention(torch.randn(4, 2, 64), pool[0], pool[1], table, 40)
