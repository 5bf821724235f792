"""Paged attention over the K/V pool, in plain PyTorch.

Contract: one engine step is a flat list of T token rows. Decode rows come first (one row per
decoding sequence), then each prefill chunk's rows, contiguous per sequence. Before attention
runs, the step's new K/V rows are written into the pool at `slot_mapping`; attention then
reads every visible key of a sequence from its block table, so a sequence's earlier chunks,
prefix-cache hits and imported (handed-off) blocks are all read the same way.

- Prefill chunks: read in place from the pool by `paged_prefill` (a C kernel: causal, fp32
  softmax, a row's bits fixed by its position and keys whatever the chunking) when it is built on
  this machine; otherwise SDPA per sequence, grouped-query via `enable_gqa` (K/V never
  expanded), a causal mask offset by the tokens already in cache.
- The pool may hold a narrower dtype than the compute dtype (bf16 K/V, fp32 math): gathered
  K/V are widened after the gather, so every reader sees the same rounded values.
- On a CUDA device every row, decode or prefill, goes through one Triton kernel reading the
  pool in place (model/gpu/attention.py) over the step's `tiles`, built by the runner.
- Decode rows: read in place from the pool by `paged_decode` (a C kernel walking each row's
  block table, fp32 softmax, batch-invariant by construction) when it is built on this machine;
  otherwise the G = H_q / H_kv query heads that share a K/V head are treated as G query rows of
  one SDPA call per K/V head over a padded gather, so K/V are gathered once and never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import paged_decode, paged_prefill


@dataclass(frozen=True)
class PrefillSlice:
    """One sequence's prefill chunk inside the flat step."""

    q_start: int  # first row of this chunk in the flat step
    q_len: int  # rows in this chunk
    ctx_len: int  # visible keys after this chunk (cached + new)
    block_table: torch.Tensor  # [ceil(ctx_len / B)] int64


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows whose K/V is read padded to the same length (a function of each row's own
    length only), so a row's attention bits never depend on its batch mates."""

    rows: torch.Tensor  # [g] int64 indices into the step's decode rows
    block_tables: torch.Tensor  # [g, M] int64, padded with block 0
    key_mask: torch.Tensor  # [g, 1, 1, M * B] additive: 0 where the key is visible, -inf past the end


@dataclass(frozen=True)
class DecodeBatch:
    """All decode rows of the step: rows [0, num_rows) of the flat step."""

    num_rows: int
    groups: tuple[DecodeGroup, ...]
    block_tables: torch.Tensor | None = None  # [num_rows, M] int64, padded with block 0 (in-place kernel)
    context_lens: torch.Tensor | None = None  # [num_rows] int64 visible keys per row (in-place kernel)


@dataclass(frozen=True)
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block * B + offset for each new row
    decode: DecodeBatch | None
    prefills: tuple[PrefillSlice, ...]
    tiles: object | None = None  # model/gpu/attention.TileMap on a CUDA pool (every row in one kernel)


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter new rows into one layer's pool.  cache_*: [N, B, H, D]; k, v: [T, H, D].

    Rows are copied as flat [H * D] rows: torch's index_copy_ over a 3-D source took ~17 ms for
    512 bf16 rows on 2 threads (an AVX512-BF16 EPYC), the same copy of 2-D rows ~0.03 ms."""
    num_rows, width = k.shape[0], k.shape[1] * k.shape[2]
    cache_k.view(-1, width).index_copy_(0, slots, k.reshape(num_rows, width))
    cache_v.view(-1, width).index_copy_(0, slots, v.reshape(num_rows, width))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, meta: AttnMetadata
) -> torch.Tensor:
    """q: [T, H_q, D]; k, v: [T, H_kv, D] (this step's rows, already in the pool) -> [T, H_q, D]."""
    if meta.tiles is not None:
        from pdserve.model.gpu.attention import paged_attention as gpu_paged_attention
        return gpu_paged_attention(q, cache_k, cache_v, meta.tiles)
    if not meta.prefills and meta.decode is not None and meta.decode.num_rows == q.shape[0]:
        return _decode_attention(q, cache_k, cache_v, meta.decode)  # a decode-only step: no copy
    out = torch.empty_like(q)
    if meta.decode is not None and meta.decode.num_rows:
        n = meta.decode.num_rows
        out[:n] = _decode_attention(q[:n], cache_k, cache_v, meta.decode)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], cache_k, cache_v, chunk)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [N, B, H, D] -> [H, length, D] for one sequence."""
    blocks = cache.index_select(0, block_table)  # [nb, B, H, D]
    return blocks.flatten(0, 1)[:length].transpose(0, 1)


def _prefill_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, chunk: PrefillSlice
) -> torch.Tensor:
    """q: [S, H_q, D] for S new rows after ctx_len - S cached rows -> [S, H_q, D]."""
    if paged_prefill.eligible(cache_k):
        return paged_prefill.prefill_attention(q, cache_k, cache_v, chunk.block_table, chunk.ctx_len)
    scale = q.shape[-1] ** -0.5
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H_q, S, D]
    if chunk.ctx_len == chunk.q_len:
        # Whole context is new: use this step's rows directly (same values as the pool holds).
        kh = k_new.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
        vh = v_new.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kh = _gather(cache_k, chunk.block_table, chunk.ctx_len).unsqueeze(0).to(q.dtype)  # [1, H_kv, C, D]
        vh = _gather(cache_v, chunk.block_table, chunk.ctx_len).unsqueeze(0).to(q.dtype)
        offset = chunk.ctx_len - chunk.q_len
        q_pos = torch.arange(chunk.q_len).unsqueeze(1) + offset  # [S, 1]
        k_pos = torch.arange(chunk.ctx_len).unsqueeze(0)  # [1, C]
        mask = k_pos <= q_pos  # [S, C]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)  # [S, H_q, D]


def _decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """q: [Bd, H_q, D], one row per sequence -> [Bd, H_q, D]."""
    if batch.block_tables is not None and paged_decode.eligible(cache_k):
        return paged_decode.decode_attention(q, cache_k, cache_v, batch.block_tables, batch.context_lens)
    if not batch.groups:
        raise ValueError("decode rows without padded groups need the in-place kernel, which this pool cannot use")
    out = torch.empty_like(q)
    for group in batch.groups:
        out[group.rows] = _decode_group(q.index_select(0, group.rows), cache_k, cache_v, group)
    return out


def _decode_group(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """q: [g, H_q, D] -> [g, H_q, D]; K/V gathered once per K/V head, never repeated per query head."""
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = cache_k.shape[2]
    flat = group.block_tables.flatten()  # [g * M]; index_select is ~4x faster than tensor indexing here
    span = group.block_tables.shape[1] * cache_k.shape[1]  # M * B
    # widen (if the pool is narrower) while contiguous, then view as [g, H_kv, M*B, D]
    kh = cache_k.index_select(0, flat).to(q.dtype).view(num_rows, span, num_kv_heads, head_dim).transpose(1, 2)
    vh = cache_v.index_select(0, flat).to(q.dtype).view(num_rows, span, num_kv_heads, head_dim).transpose(1, 2)
    qh = q.view(num_rows, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [g, H_kv, G, D]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=group.key_mask, scale=head_dim**-0.5)
    return o.reshape(num_rows, num_q_heads, head_dim)
