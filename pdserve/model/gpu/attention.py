"""Paged attention on the GPU: one Triton kernel for decode rows and prefill chunks alike, reading
K/V in place from the pool through each sequence's block table.

Contract: decode rows (one per sequence, first in the step) run one program per (row, K/V head),
the G query heads that share the K/V head stacked as the rows of one tensor-core tile, so each
key is read once per K/V head. Prefill chunks are cut into tiles of at most TILE_ROWS consecutive
rows of one sequence, one program per (tile, query head). Row i of a tile sits at position
pos0 + i and sees keys 0..pos0 + i (causal, whatever is cached before it). Both kernels visit keys
in KEY_BLOCK blocks counted from position 0 with an fp32 online softmax, so a row's bits depend
only on its query, its position and its keys: not on its batch mates, the tile it shares or how
the prompt was chunked (blocks a row cannot see leave its sums exactly unchanged: weights of
exactly zero). A decode row and a prefill row of the same position may differ in the last bits
(two kernels); the engine keeps every position on one of them: prompts on the prefill kernel,
outputs (and their recompute replays, runner.py) on the decode kernel. That is what lets a
prefill worker and a decode worker agree bit for bit with a colocated one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TILE_ROWS = 16  # prefill rows per program; one constant for every step (64 ran a 2k prefill slower on an H200)
KEY_BLOCK = 64  # prefill: keys per inner step, counted from position 0
DECODE_KEYS = 128  # decode: keys per inner step (fewer, longer steps: a decode program is latency-bound)


@dataclass(frozen=True)
class TileMap:
    """Where each tile's rows and keys are, on the pool's device."""

    tables: torch.Tensor  # [S, M] int32: the step's block tables, one per sequence (decode rows, then chunks)
    tile_seq: torch.Tensor  # [G] int32 index into tables
    tile_row: torch.Tensor  # [G] int32 first flat row of the tile
    tile_len: torch.Tensor  # [G] int32 rows in the tile (1..TILE_ROWS)
    tile_pos: torch.Tensor  # [G] int32 position of the tile's first row
    num_decode: int = 0  # the first num_decode tiles are the decode rows, tile i = row i = tables[i]

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])


def tile_map(decode_tables: list[list[int]], decode_lens: list[int], chunks: list[tuple[list[int], int, int, int]],
             device: torch.device) -> TileMap:
    """decode_tables/decode_lens: each decode row's block table and visible keys (rows 0..Bd-1);
    chunks: (block table, first flat row, rows, visible keys after the chunk) per prefill chunk."""
    tables = [list(t) for t in decode_tables] + [list(t) for t, _, _, _ in chunks]
    tiles: list[tuple[int, int, int, int]] = [(i, i, 1, n - 1) for i, n in enumerate(decode_lens)]
    for c, (_, row, rows, ctx) in enumerate(chunks):
        first_pos = ctx - rows
        for off in range(0, rows, TILE_ROWS):
            tiles.append((len(decode_tables) + c, row + off, min(TILE_ROWS, rows - off), first_pos + off))
    width = max((len(t) for t in tables), default=1) or 1
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables] or [[0]], dtype=torch.int32)
    cols = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 4)
    flat = torch.cat([padded.flatten(), cols.t().flatten()]).to(device, non_blocking=True)  # one copy to the device
    cut = padded.numel()
    g = cols.shape[0]
    t = flat[cut:].view(4, g)
    return TileMap(flat[:cut].view(padded.shape), t[0], t[1], t[2], t[3], len(decode_tables))


@triton.jit
def _key_block(table, start, n_keys, k_ptr, v_ptr, d, dk, kv_head, stride_kn, stride_kb, stride_kh,
               BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """Keys start..start + KEYS of one sequence, gathered through its block table: (j, inside, k, v)."""
    j = start + tl.arange(0, KEYS)
    inside = j < n_keys
    block = tl.load(table + j // BLOCK, mask=inside, other=0).to(tl.int64)
    slot = block * stride_kn + (j % BLOCK) * stride_kb + kv_head * stride_kh
    k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=inside[:, None] & dk[None, :], other=0.0)  # [KEYS, DP]
    v = tl.load(v_ptr + slot[:, None] + d[None, :], mask=inside[:, None] & dk[None, :], other=0.0)
    return j, inside, k, v


@triton.jit
def _softmax_step(q, k, v, visible, m_i, l_i, acc, scale2, IEEE: tl.constexpr):
    """One key block of the online softmax: scores where `visible`, -inf elsewhere (exact zeros)."""
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))  # [rows, KEYS] fp32
    s = tl.where(visible, qk * scale2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, tile_pos, stride_qt, stride_qh, stride_ot, stride_oh,
                  stride_kn, stride_kb, stride_kh, stride_table, scale2, GROUP: tl.constexpr, GP: tl.constexpr,
                  BLOCK: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GP)  # the query heads of this K/V head, padded to a tile's least height
    d = tl.arange(0, DP)
    dk = d < D
    heads = kv_head * GROUP + tl.where(g < GROUP, g, 0)
    row64 = row.to(tl.int64)
    q = tl.load(q_ptr + row64 * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=dk[None, :], other=0.0)
    n_keys = tl.load(tile_pos + row) + 1
    table = tables_ptr + row64 * stride_table
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    for start in range(0, n_keys, KEYS):
        j, inside, k, v = _key_block(table, start, n_keys, k_ptr, v_ptr, d, dk, kv_head, stride_kn, stride_kb,
                                     stride_kh, BLOCK, KEYS)
        m_i, l_i, acc = _softmax_step(q, k, v, inside[None, :], m_i, l_i, acc, scale2, IEEE)
    out = acc / l_i[:, None]
    tl.store(o_ptr + row64 * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(g[:, None] < GROUP) & dk[None, :])


@triton.jit
def _paged_prefill(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, tile_seq, tile_row, tile_len, tile_pos, first_tile,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_kn, stride_kb, stride_kh,
                     stride_table, scale2, GROUP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     TILE: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    tile = first_tile + tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq + tile)
    row0 = tl.load(tile_row + tile)
    rows = tl.load(tile_len + tile)
    pos0 = tl.load(tile_pos + tile)
    r = tl.arange(0, TILE)
    d = tl.arange(0, DP)  # head dim padded to a power of two >= 16 (a dot's least width)
    dk = d < D
    live = r < rows
    pos = pos0 + tl.where(live, r, 0)  # padding rows repeat row 0 (never stored)
    q_rows = (row0 + tl.where(live, r, 0)).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=dk[None, :], other=0.0)  # [TILE, D]
    m_i = tl.full((TILE,), float("-inf"), tl.float32)
    l_i = tl.zeros((TILE,), tl.float32)
    acc = tl.zeros((TILE, DP), tl.float32)
    n_keys = pos0 + rows
    table = tables_ptr + seq.to(tl.int64) * stride_table
    for start in range(0, n_keys, KEYS):
        j, inside, k, v = _key_block(table, start, n_keys, k_ptr, v_ptr, d, dk, kv_head, stride_kn, stride_kb,
                                     stride_kh, BLOCK, KEYS)
        m_i, l_i, acc = _softmax_step(q, k, v, j[None, :] <= pos[:, None], m_i, l_i, acc, scale2, IEEE)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=live[:, None] & dk[None, :])


def paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """q: [T, H_q, D]; cache_*: [N, B, H_kv, D] of one layer (the step's new rows already written)
    -> [T, H_q, D] in q's dtype. K/V are read in the pool's dtype and widened in registers."""
    num_rows, num_heads, head_dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    if num_rows == 0 or tiles.num_tiles == 0:
        return out
    if cache_k.dtype != q.dtype:
        raise ValueError(f"the GPU kernel attends in the pool's dtype ({cache_k.dtype}); queries are {q.dtype}")
    if cache_k.stride(-1) != 1 or cache_k.stride() != cache_v.stride():
        raise ValueError("the pool's K and V must share strides with contiguous heads")
    num_kv_heads = cache_k.shape[2]
    group = num_heads // num_kv_heads
    scale2 = head_dim ** -0.5 * 1.4426950408889634  # softmax in base 2: e^x = 2^(x log2 e)
    dp, ieee = max(16, triton.next_power_of_2(head_dim)), q.dtype == torch.float32
    common = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache_k.stride(0), cache_k.stride(1),
              cache_k.stride(2), tiles.tables.stride(0), scale2)
    if tiles.num_decode:
        _paged_decode[(tiles.num_decode, num_kv_heads)](
            q, cache_k, cache_v, out, tiles.tables, tiles.tile_pos, *common, GROUP=group,
            GP=max(16, triton.next_power_of_2(group)), BLOCK=cache_k.shape[1], D=head_dim, DP=dp, KEYS=DECODE_KEYS,
            IEEE=ieee, num_warps=4, num_stages=3)
    if tiles.num_tiles > tiles.num_decode:
        _paged_prefill[(tiles.num_tiles - tiles.num_decode, num_heads)](
            q, cache_k, cache_v, out, tiles.tables, tiles.tile_seq, tiles.tile_row, tiles.tile_len, tiles.tile_pos,
            tiles.num_decode, *common, GROUP=group, BLOCK=cache_k.shape[1], D=head_dim, DP=dp, TILE=TILE_ROWS,
            KEYS=KEY_BLOCK, IEEE=ieee, num_warps=4, num_stages=2)
    return out
