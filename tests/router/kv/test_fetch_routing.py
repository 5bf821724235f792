"""The prefix policy with K/V sharing (router/policy/policies.py `_prefix_with_fetch`, router/kv/fetch_plan.py):
a candidate's cost is its queue + the fetch of the prefix it lacks + the prefill of the rest;
hand-worked cases, and random colocated clusters against a plain per-worker reference built on
the scalar `plan_fetch`."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from tests.router.router_fixtures import colocated

from pdserve.router.kv.fetch_plan import (
    FETCH,
    LOCAL,
    RECOMPUTE,
    fetch_credit,
    leading_run,
    plan_fetch,
    plan_join,
)
from pdserve.router.messages import RouteRequest
from pdserve.router.policy.policies import Choice, PolicyContext, prefix_aware
from pdserve.router.pricing.cost import CostModel
from pdserve.router.state.snapshot import prefill_coefficients
from pdserve.router.synthetic import chain

# 1 ms per prompt token, 1 MB of K/V per token, 2 GB/s on a host, 100 MB/s across, no overheads
COST = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.0, decode_step_base_s=0.01, decode_step_s_per_seq=0.001,
                 same_host_bytes_per_s=2e9, cross_host_bytes_per_s=1e8, transfer_overhead_s=0.0,
                 kv_bytes_per_token=1_000_000)
SHARING = PolicyContext(COST, ttft_slo_s=10.0, tpot_slo_s=1.0, kv_sharing=True)
LOCAL_ONLY = PolicyContext(COST, ttft_slo_s=10.0, tpot_slo_s=1.0)
DOC = tuple(chain(1, 0, 8))  # an 8-block prefix (128 tokens)
LONG = RouteRequest("long", prompt_tokens=8 * 16 + 10, expected_output_tokens=10, block_hashes=DOC)


def test_a_fetch_beats_recomputing_when_the_holder_is_busy():
    # w0 holds the prefix behind 1 s of queue; w1 idle: fetch 128 MB at 2 GB/s (0.064 s) + 10 tokens
    snapshot = colocated([dict(pending=1000, held=frozenset(DOC)), dict()])
    choice = prefix_aware(snapshot, LONG, SHARING)
    assert (choice, choice.ttft_s) == (Choice(1, 1, 0, 0), pytest.approx(0.074))
    assert prefix_aware(snapshot, LONG, LOCAL_ONLY).ttft_s == pytest.approx(0.138)  # w1 recomputes all 138


@pytest.mark.parametrize("pending, winner", [(50, 0), (100, 1)])
def test_the_longest_local_prefix_loses_only_when_its_queue_dominates(pending, winner):
    # w0: pending ms + 10 ms; w1: 64 ms fetch + 10 ms
    snapshot = colocated([dict(pending=pending, held=frozenset(DOC)), dict()])
    assert prefix_aware(snapshot, LONG, SHARING).prefill_slot == winner


def test_a_slow_cross_host_fetch_is_not_planned():
    # 128 MB at 100 MB/s is 1.28 s, more than the 0.128 s of prefill it saves: w1 recomputes (0.138)
    snapshot = colocated([dict(host="h0", pending=100, held=frozenset(DOC)), dict(host="h1")])
    choice = prefix_aware(snapshot, LONG, SHARING)
    assert (choice.prefill_slot, choice.ttft_s) == (0, pytest.approx(0.110))  # w0's queue is cheaper than either


def test_a_running_fetch_of_a_shorter_prefix_is_joined_when_waiting_for_it_is_cheaper():
    whole = plan_fetch("w0", DOC, {"w0": set(), "w1": set(DOC)}, 8, COST, lambda w: True)
    assert (whole.decision, whole.local_blocks, whole.remote_blocks, whole.fetch_s) == (FETCH, 0, 8, pytest.approx(0.064))
    # another fetch lands DOC's first 6 blocks at w0 in 10 ms: then 2 blocks (32 MB, 16 ms) beat 64 ms
    rest = plan_join(whole, 6, 0.010, COST, True)
    assert (rest.decision, rest.holder, rest.local_blocks, rest.remote_blocks) == (FETCH, "w1", 6, 8)
    assert (rest.fetch_bytes, rest.fetch_s, rest.saved_s) == (32_000_000, pytest.approx(0.016), pytest.approx(0.032))
    assert plan_join(whole, 6, 0.050, COST, True) is None  # 50 + 16 ms > 64 ms: its own fetch now
    # with 40 ms per fetch the 2-block remainder costs more (56 ms) than its prefill (32 ms): joined,
    # it is recomputed (10 + 32 ms < 104 ms for the whole fetch)
    slow = replace(COST, transfer_overhead_s=0.04)
    whole = plan_fetch("w0", DOC, {"w0": set(), "w1": set(DOC)}, 8, slow, lambda w: True)
    assert (whole.decision, whole.fetch_s) == (FETCH, pytest.approx(0.104))
    rest = plan_join(whole, 6, 0.010, slow, True)
    assert (rest.decision, rest.fetch_s, rest.saved_s) == (RECOMPUTE, pytest.approx(0.056), pytest.approx(0.032))


def test_plan_fetch_terms():
    held = {"w0": set(DOC[:5]), "w1": set(DOC), "w2": set(DOC[1:])}  # w2 lacks the first block: no run
    terms = plan_fetch("w0", DOC, held, 8, COST, lambda w: True)
    assert (terms.decision, terms.holder, terms.local_blocks, terms.remote_blocks) == (FETCH, "w1", 5, 8)
    assert terms.fetch_bytes == 3 * 16 * 1_000_000 and terms.fetch_s == pytest.approx(0.024)
    assert terms.saved_s == pytest.approx(0.048)
    assert plan_fetch("w1", DOC, held, 8, COST, lambda w: True).decision == LOCAL
    assert plan_fetch("w0", DOC, held, 8, COST, lambda w: False).decision == RECOMPUTE  # 0.48 s > 0.048 s
    assert plan_fetch("w0", DOC, held, 6, COST, lambda w: True).remote_blocks == 6  # the usable cap
    assert leading_run(DOC, held["w2"]) == 0


def _reference(snapshot, request, ctx, held, hosts):
    """Per worker: queue + plan_fetch's fetch (when it says FETCH) + prefill of the rest."""
    bs, best = ctx.cost.block_size_tokens, None
    usable = (request.prompt_tokens - 1) // bs
    ids = [f"w{i}" for i in range(len(held))]
    for i, wid in enumerate(ids):
        terms = plan_fetch(wid, request.block_hashes, dict(zip(ids, held)), usable, ctx.cost,
                           lambda w: hosts[int(w[1:])] == hosts[i])
        hit = terms.remote_blocks if terms.decision == FETCH else terms.local_blocks
        fetch_s = terms.fetch_s if terms.decision == FETCH else 0.0
        queue_s = ctx.cost.queue_s(snapshot.prefill.pending_tokens[i])
        ttft = queue_s + fetch_s + ctx.cost.prefill_s(request.prompt_tokens - hit * bs)
        if best is None or ttft < best[1] - 1e-12:
            best = (i, ttft)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_random_clusters_match_the_per_worker_reference(seed):
    rng = random.Random(seed)
    n = rng.randrange(2, 6)
    hosts = [f"h{rng.randrange(2)}" for _ in range(n)]
    held = [set(DOC[: rng.randrange(0, 9)]) for _ in range(n)]
    workers = [dict(host=hosts[i], pending=rng.randrange(0, 300), held=frozenset(held[i])) for i in range(n)]
    snapshot = colocated(workers)
    choice = prefix_aware(snapshot, LONG, SHARING)
    slot, ttft = _reference(snapshot, LONG, SHARING, held, hosts)
    assert choice.ttft_s == pytest.approx(ttft, rel=1e-9, abs=1e-12)
    assert choice.prefill_slot == slot or choice.ttft_s == pytest.approx(_reference_at(snapshot, held, hosts, choice.prefill_slot))
    assert choice.prefill_hit_blocks == leading_run(DOC, held[choice.prefill_slot])  # holds count own blocks only


def _reference_at(snapshot, held, hosts, slot):
    ids = [f"w{i}" for i in range(len(held))]
    terms = plan_fetch(ids[slot], DOC, dict(zip(ids, held)), 8, COST, lambda w: hosts[int(w[1:])] == hosts[slot])
    hit = terms.remote_blocks if terms.decision == FETCH else terms.local_blocks
    fetch_s = terms.fetch_s if terms.decision == FETCH else 0.0
    return COST.queue_s(snapshot.prefill.pending_tokens[slot]) + fetch_s + COST.prefill_s(LONG.prompt_tokens - hit * 16)


def test_fetch_credit_is_plan_fetch_per_slot():
    own = __import__("numpy").array([0, 3, 8, 5])
    coef = prefill_coefficients([COST] * 4)  # every slot at COST's prefill terms
    eff, fetch_s = fetch_credit(COST, own, 8, __import__("numpy").array([1, 0, 1, 1]), coef)
    assert list(eff) == [8, 3, 8, 8] and list(fetch_s) == pytest.approx([0.064, 0.0, 0.0, 0.024])
