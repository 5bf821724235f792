"""Every policy's choice on hand-built snapshots, and every early-rejection reason."""

from __future__ import annotations

import pytest
from tests.router.router_fixtures import colocated, pd

from pdserve.router.messages import RejectReason, RouteRequest
from pdserve.router.policy.policies import (
    Choice,
    PolicyContext,
    Refusal,
    join_shortest_queue,
    prefix_aware,
    round_robin,
    slo_aware,
)
from pdserve.router.pricing.cost import CostModel
from pdserve.router.synthetic import chain

# Round numbers: 1 ms per prompt token, 10 ms + 1 ms/seq per decode step, 1 MB of K/V per token,
# 1 GB/s on a host and 100 MB/s across hosts, no fixed overheads.
COST = CostModel(
    prefill_s_per_token=1e-3,
    prefill_overhead_s=0.0,
    decode_step_base_s=0.01,
    decode_step_s_per_seq=0.001,
    same_host_bytes_per_s=1e9,
    cross_host_bytes_per_s=1e8,
    transfer_overhead_s=0.0,
    kv_bytes_per_token=1_000_000,
)
CTX = PolicyContext(COST, ttft_slo_s=10.0, tpot_slo_s=1.0)
REQ = RouteRequest("r", prompt_tokens=100, expected_output_tokens=10)
DOC = tuple(chain(1, 0, 8))  # an 8-block shared prefix
LONG = RouteRequest("long", prompt_tokens=8 * 16 + 10, expected_output_tokens=10, block_hashes=DOC)


def two_by_two():
    # p0 idle on h0, p1 with 0.1 s of queue on h1; d0 idle on h1, d1 with batch 2 on h0
    return pd(
        [dict(host="h0", pending=0), dict(host="h1", pending=100)],
        [dict(host="h1", batch=0), dict(host="h0", batch=2)],
    )


def test_jsq_takes_shortest_queues_independently():
    assert join_shortest_queue(two_by_two(), REQ, CTX) == Choice(0, 0, 0, 0)


def test_slo_aware_prices_the_transfer_path():
    # TTFT: (p0,d0) 0.1+1.0 cross; (p0,d1) 0.1+0.1+0.012 same host; (p1,d0) 0.2+0.1; (p1,d1) 0.2+1.0+0.012
    assert slo_aware(two_by_two(), REQ, CTX) == Choice(0, 1, 0, 0)


def test_round_robin_rotates_over_workers_with_headroom():
    snapshot = pd([{}, {}], [{}, dict(free=0), {}])
    picks = [round_robin(snapshot, REQ, PolicyContext(COST, turn=t)) for t in range(4)]
    assert [(c.prefill_slot, c.decode_slot) for c in picks] == [(0, 0), (1, 2), (0, 0), (1, 2)]


def test_longest_prefix_loses_to_a_shorter_queue():
    # p0 holds the whole prefix but has 1 s queued: 1.0 + 0.010; p1 holds nothing, idle: 0.138
    snapshot = pd([dict(pending=1000, held=frozenset(DOC)), dict(pending=0)], [{}])
    assert prefix_aware(snapshot, LONG, CTX) == Choice(1, 0, 0, 0)


def test_longest_prefix_wins_when_queues_are_equal():
    snapshot = pd([dict(pending=0, held=frozenset(DOC)), dict(pending=0)], [{}])
    assert prefix_aware(snapshot, LONG, CTX) == Choice(0, 0, 8, 0)


def test_prefix_visible_at_decode_shrinks_the_transfer():
    # d1 already sees the prefix: 10 tokens cross host (0.1 s) beats 138 tokens (1.38 s) despite batch 3
    snapshot = pd([dict(host="h0")], [dict(host="h1"), dict(host="h1", batch=3, held=frozenset(DOC))])
    assert prefix_aware(snapshot, LONG, CTX) == Choice(0, 1, 0, 8)
    assert slo_aware(snapshot, LONG, CTX) == Choice(0, 1, 0, 8)  # every policy reads the caches' hits


def test_only_leading_blocks_count_as_a_hit():
    snapshot = pd([dict(held=frozenset(DOC[1:]))], [dict(held=frozenset(DOC[:3] + DOC[4:]))])
    assert prefix_aware(snapshot, LONG, CTX) == Choice(0, 0, 0, 3)


def test_full_prompt_hit_still_computes_the_last_block():
    request = RouteRequest("exact", prompt_tokens=8 * 16, expected_output_tokens=0, block_hashes=DOC)
    snapshot = pd([dict(held=frozenset(DOC))], [dict(held=frozenset(DOC))])
    assert prefix_aware(snapshot, request, CTX) == Choice(0, 0, 7, 8)


@pytest.mark.parametrize("policy", [round_robin, join_shortest_queue, slo_aware, prefix_aware])
def test_colocated_routes_are_one_worker(policy):
    snapshot = colocated([dict(pending=50, batch=0), dict(pending=10, batch=1), dict(pending=0, batch=20, free=0)])
    choice = policy(snapshot, REQ, PolicyContext(COST, turn=1))
    assert choice.prefill_slot == choice.decode_slot
    assert choice.prefill_slot != 2  # no headroom


def test_colocated_jsq_sums_pending_tokens_and_batch():
    snapshot = colocated([dict(pending=5, batch=5), dict(pending=8, batch=1), dict(pending=0, batch=9)])
    assert join_shortest_queue(snapshot, REQ, CTX) == Choice(1, 1, 0, 0)  # 10 vs 9 vs 9: lower slot
    snapshot = colocated([dict(pending=5, batch=5), dict(pending=8, batch=1), dict(pending=0, batch=8)])
    assert join_shortest_queue(snapshot, REQ, CTX) == Choice(2, 2, 0, 0)


def refusal(result) -> Refusal:
    assert isinstance(result, Refusal), result
    return result


@pytest.mark.parametrize("policy", [round_robin, join_shortest_queue, slo_aware, prefix_aware])
def test_no_route_when_a_pool_is_empty(policy):
    assert refusal(policy(pd([{}], []), REQ, CTX)).reason is RejectReason.NO_ROUTE


@pytest.mark.parametrize("policy", [round_robin, join_shortest_queue, slo_aware, prefix_aware])
def test_no_decode_capacity(policy):
    # 110 tokens need 7 blocks at D
    result = refusal(policy(pd([{}], [dict(free=6)]), REQ, CTX))
    assert result.reason is RejectReason.NO_DECODE_CAPACITY and result.retry_after_s == CTX.retry_after_s


@pytest.mark.parametrize("policy", [round_robin, join_shortest_queue, slo_aware, prefix_aware])
def test_no_transfer_buffer(policy):
    # 100 prompt tokens need 7 blocks at P until D has pulled them
    assert refusal(policy(pd([dict(free=6)], [dict(free=7)]), REQ, CTX)).reason is RejectReason.NO_TRANSFER_BUFFER


def test_tpot_slo_rejects_before_prefill():
    ctx = PolicyContext(COST, ttft_slo_s=10.0, tpot_slo_s=0.0115)  # batch 2 -> step(3) = 13 ms
    result = refusal(slo_aware(pd([{}], [dict(batch=2), dict(batch=4)]), REQ, ctx))
    assert result.reason is RejectReason.TPOT_SLO


def test_tpot_slo_skips_only_the_slow_decode_worker():
    ctx = PolicyContext(COST, ttft_slo_s=10.0, tpot_slo_s=0.0115)
    assert slo_aware(pd([{}], [dict(batch=2), dict(batch=0)]), REQ, ctx) == Choice(0, 1, 0, 0)


def test_ttft_slo_rejects_with_retry_after_the_excess():
    result = refusal(slo_aware(two_by_two(), REQ, PolicyContext(COST, ttft_slo_s=0.05, tpot_slo_s=1.0)))
    assert result.reason is RejectReason.TTFT_SLO
    assert result.retry_after_s == pytest.approx(0.212 - 0.05)


def test_request_slo_overrides_the_default():
    request = RouteRequest("tight", 100, 10, ttft_slo_s=0.2)
    assert refusal(slo_aware(two_by_two(), request, CTX)).reason is RejectReason.TTFT_SLO
