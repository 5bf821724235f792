"""K/V byte ledger, handoff sets and phase work vectors: worked numbers and properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.ledger import (
    BlockGeometry,
    decode_work,
    handoff_sets,
    kv_bytes,
    kv_bytes_per_token,
    logical_transfer_bytes,
    lower_bound_s,
    mixed_work,
    physical_transfer_bytes,
    prefill_work,
    prefix_handoff_counts,
    slot_bounds,
)

TOY = BlockGeometry(layers=4, d_model=64, d_ff=160, q_heads=8, kv_heads=2, head_dim=8, dtype_bytes=2)
C, R = 1e12, 1e11


def test_running_configuration_is_128_kib_per_token():
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024
    assert kv_bytes(4096, 32, 8, 128, 2) == 512 * 1024 * 1024


def test_handoff_example():
    blocks = [f"b{i}" for i in range(8)]
    sets = handoff_sets(blocks, blocks[:3], blocks[:1])
    assert sets.compute_blocks == tuple(blocks[3:]) and sets.transfer_blocks == tuple(blocks[1:])
    assert logical_transfer_bytes(7, 4, 4, 2, 8, 2) == 7168
    assert prefix_handoff_counts(8, 3, 1) == (5, 7)


def test_handoff_rejects_foreign_and_duplicate_blocks():
    with pytest.raises(ValueError, match="outside the prompt"):
        handoff_sets(["a", "b"], ["c"], [])
    with pytest.raises(ValueError, match="unique"):
        handoff_sets(["a", "a"], [], [])
    with pytest.raises(ValueError):
        prefix_handoff_counts(4, 5, 0)


def test_physical_bytes_pad_headers_and_resends():
    assert physical_transfer_bytes(7168, 4096) == 8192
    assert physical_transfer_bytes(7168, 4096, header_bytes_per_chunk=64, resent_bytes=4096) == 8192 + 128 + 4096


blocks_st = st.lists(st.integers(0, 40), unique=True, min_size=1, max_size=20).map(lambda xs: [f"b{x}" for x in xs])


@given(blocks_st, st.data())
def test_transfer_set_never_depends_on_prefill_reuse(blocks, data):
    visible = data.draw(st.lists(st.sampled_from(blocks), unique=True))
    reuse_a = data.draw(st.lists(st.sampled_from(blocks), unique=True))
    reuse_b = data.draw(st.lists(st.sampled_from(blocks), unique=True))
    a, b = handoff_sets(blocks, reuse_a, visible), handoff_sets(blocks, reuse_b, visible)
    assert a.transfer_blocks == b.transfer_blocks
    assert set(a.compute_blocks) | set(reuse_a) == set(blocks)
    assert set(a.transfer_blocks).isdisjoint(visible)


@given(st.integers(0, 64), st.integers(0, 64), st.integers(0, 64), st.integers(1, 32))
def test_prefix_counts_match_set_algebra(n, r, v, block_tokens):
    r, v = min(r, n), min(v, n)
    blocks = [f"b{i}" for i in range(n)]
    sets = handoff_sets(blocks, blocks[:r], blocks[:v])
    assert prefix_handoff_counts(n, r, v) == (len(sets.compute_blocks), len(sets.transfer_blocks))
    assert logical_transfer_bytes(len(sets.transfer_blocks), block_tokens, 4, 2, 8, 2) == (n - v) * block_tokens * 256


def test_phase_worked_example():
    bounds = slot_bounds(TOY, 16, 8, [48, 49, 50], C, R)
    assert TOY.params_per_layer == 40960 and TOY.weight_bytes == 327680 and TOY.kv_bytes_per_token == 256
    assert round(bounds.prefill_lb_s * 1e6, 3) == 5.513
    assert round(bounds.decode_lb_s * 1e6, 3) == 3.661
    assert round(bounds.mixed_lb_s * 1e6, 3) == 6.647
    assert round(bounds.dilation, 3) == 1.816


def _rounds(value_s: float, target_us: float) -> bool:
    return round(value_s * 1e6, 3) == target_us


def test_phase_rows_are_the_unique_small_solution():
    """Search prefill (N, T0) and decode (B, sum s) for rows reproducing the printed bounds."""
    prefill_rows = [
        (n, t0)
        for n, t0 in itertools.product(range(1, 65), range(0, 257))
        if _rounds(lower_bound_s(prefill_work(TOY, n, t0), C, R), 5.513)
    ]
    assert prefill_rows == [(16, 8)]
    decode_rows = []
    for batch, total in itertools.product(range(1, 17), range(1, 400)):
        if total < batch:
            continue
        lengths = [total - (batch - 1)] + [1] * (batch - 1)  # only the sum matters
        decode = decode_work(TOY, lengths)
        mixed = mixed_work([prefill_work(TOY, 16, 8), decode])
        if _rounds(lower_bound_s(decode, C, R), 3.661) and _rounds(lower_bound_s(mixed, C, R), 6.647):
            decode_rows.append((batch, total))
    assert decode_rows == [(3, 147)]


@given(st.integers(1, 64), st.integers(0, 256), st.lists(st.integers(1, 512), min_size=1, max_size=8))
def test_mixed_bound_dominates_parts(n, t0, lengths):
    prefill, decode = prefill_work(TOY, n, t0), decode_work(TOY, lengths)
    mixed = mixed_work([prefill, decode])
    mixed_lb = lower_bound_s(mixed, C, R)
    assert mixed_lb >= max(prefill.flops, decode.flops) / C
    assert mixed_lb >= max(lower_bound_s(prefill, C, R), lower_bound_s(decode, C, R))
    assert mixed.weight_bytes == TOY.weight_bytes


@given(st.integers(1, 64), st.integers(0, 256))
def test_prefill_pairs_are_causal(n, t0):
    work = prefill_work(TOY, n, t0)
    assert work.causal_pairs == sum(t0 + i + 1 for i in range(n))


def test_geometry_rejects_nonpositive():
    with pytest.raises(ValueError):
        BlockGeometry(0, 64, 160, 8, 2, 8, 2)
    with pytest.raises(ValueError):
        decode_work(TOY, [0])


@pytest.mark.parametrize("args, blocks", [
    ((32, 48, 2, 16, 1024), (2, 6, 3)),  # block-aligned prompt: nothing to copy at the fork
    ((10, 20, 8, 16, 1024), (1, 15, 1)),  # 8 choices of 1 block each, 7 copies of the partial prompt block
    ((100, 1000, 1, 16, 128), (7, 1, 1)),  # growth stops at max_model_len
    ((128, 0, 3, 16, 1024), (8, 0, 0)),  # nothing to grow: no block, no copy of a full prompt
])
def test_fork_blocks_counts_what_the_decode_worker_reserves(args, blocks):
    from pdserve.ledger.kv import fork_blocks

    assert fork_blocks(*args) == blocks
