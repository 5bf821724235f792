"""K/V placement terms of the one cost model (router/pricing/cost.py `fetch_s`, `promote_s`), their live
measurement (router/pricing/kv_rates.py), the K/V index's host-tier sets (router/kv/kv_index.py) and the
prefix policy pricing a host-tier hit at its promotion time (router/policy/policies.py `_prefix_priced`,
router/kv/prefix_terms.py): hand-worked exact costs, and random clusters against a per-worker
reference built on the scalar `plan_fetch`."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from tests.router.router_fixtures import ABI, MODEL, colocated

from pdserve.engine.kv.kv_events import BlockEventKind as K
from pdserve.engine.kv.kv_events import KvTier as T
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.kv.fetch_plan import FETCH, RECOMPUTE, leading_run, plan_fetch
from pdserve.router.kv.kv_index import KvDelta, KvIndex
from pdserve.router.kv.prefix_terms import PrefixTerms, host_blocks
from pdserve.router.messages import Role, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.policy.policies import PolicyContext, prefix_aware
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.kv_rates import KvRates
from pdserve.router.router import Router
from pdserve.router.synthetic import EventFlow, chain, random_router

# 1 ms per prompt token, 1 MB of K/V per token (16 MB a block), 2 GB/s on a host, 100 MB/s across,
# host tier -> pool at 1.6 GB/s (10 ms a block), no fixed overheads unless a test sets one
COST = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.0, decode_step_base_s=0.01, decode_step_s_per_seq=0.001,
                 same_host_bytes_per_s=2e9, cross_host_bytes_per_s=1e8, transfer_overhead_s=0.0,
                 kv_bytes_per_token=1_000_000, host_copy_bytes_per_s=1.6e9, fitted=True)
DOC = tuple(chain(1, 0, 8))  # an 8-block prefix (128 tokens)
LONG = RouteRequest("long", prompt_tokens=8 * 16 + 10, expected_output_tokens=10, block_hashes=DOC)


def ctx(host: dict[str, frozenset[int]], sharing: bool = False, cost: CostModel = COST) -> PolicyContext:
    return PolicyContext(COST, ttft_slo_s=10.0, tpot_slo_s=1.0, kv_sharing=sharing, kv_cost=cost,
                         host_held=lambda w: host.get(w, frozenset()))


def test_fetch_and_promotion_seconds():
    assert COST.promote_s(8) == pytest.approx(0.080)
    assert list(COST.promote_s(np.array([0, 1, 3]))) == pytest.approx([0.0, 0.010, 0.030])
    assert COST.fetch_s(16e6, 1) == pytest.approx(0.008) and COST.fetch_s(0, 1) == 0
    measured = replace(COST, fetch_bytes_per_s=4e9, fetch_overhead_s=0.04, transfer_overhead_s=0.001)
    assert measured.fetch_s(16e6, 1) == pytest.approx(0.001 + 0.04 + 0.004)
    assert measured.fetch_s(16e6, 0) == pytest.approx(0.001 + 0.04 + 0.16)  # never faster than the cross-host rate
    with pytest.raises(ValueError):
        CostModel(host_copy_bytes_per_s=0)


@pytest.mark.parametrize("sharing", [False, True])
def test_a_host_only_prefix_loses_at_equal_queues_and_wins_when_the_other_queue_dominates(sharing):
    # w0 holds the 8 blocks only in its host tier: 80 ms promotion + 10 ms prefill = 90 ms
    # w1 holds them in its pool: queue + 10 ms
    host = {"w0": frozenset(DOC)}
    equal = colocated([dict(held=frozenset(DOC)), dict(held=frozenset(DOC))])
    choice = prefix_aware(equal, LONG, ctx(host, sharing))
    assert (choice.prefill_slot, choice.ttft_s) == (1, pytest.approx(0.010))
    assert choice.terms == PrefixTerms(0.0, 8, 0, 0.0, 1.6e9, 0, 0.0, pytest.approx(0.010), pytest.approx(0.010))
    busy = colocated([dict(held=frozenset(DOC)), dict(pending=200, held=frozenset(DOC))])  # w1: 200 ms of queue
    choice = prefix_aware(busy, LONG, ctx(host, sharing))
    assert (choice.prefill_slot, choice.ttft_s, choice.prefill_hit_blocks) == (0, pytest.approx(0.090), 8)
    t = choice.terms
    assert (t.queue_s, t.hit_blocks, t.host_blocks, t.fetch_blocks) == (0.0, 8, 8, 0)
    assert (t.host_s, t.prefill_s, t.ttft_s) == (pytest.approx(0.080), pytest.approx(0.010), pytest.approx(0.090))
    assert t.trace_fields()["route_host_s"] == 0.08 and t.trace_fields()["route_host_blocks"] == 8
    # the crossover: w1 wins again once its queue is below the 80 ms the promotion costs
    assert prefix_aware(colocated([dict(held=frozenset(DOC)), dict(pending=79, held=frozenset(DOC))]), LONG,
                        ctx(host, sharing)).prefill_slot == 1


def test_only_the_hit_s_host_blocks_are_priced():
    # w0: device blocks 0-4, host blocks 5-7 (a demoted tail): 30 ms; a host block past the hit is free
    host = {"w0": frozenset(DOC[5:]), "w1": frozenset(DOC[3:])}
    hits = np.array([8, 3])
    assert list(host_blocks(DOC, hits, ("w0", "w1"), lambda w: host[w])) == [3, 0]
    choice = prefix_aware(colocated([dict(held=frozenset(DOC))]), LONG, ctx(host))
    assert (choice.terms.host_blocks, choice.ttft_s) == (3, pytest.approx(0.030 + 0.010))


def test_a_tiny_prefix_is_recomputed_once_the_fetch_overhead_is_counted():
    tiny = RouteRequest("tiny", prompt_tokens=16 + 10, expected_output_tokens=4, block_hashes=DOC[:1])
    held = {"w0": set(), "w1": set(DOC)}
    # 16 MB at 2 GB/s = 8 ms < the 16 ms of prefill it saves: fetched without the overhead
    assert plan_fetch("w0", tiny.block_hashes, held, 1, COST, lambda w: True).decision == FETCH
    slow = replace(COST, fetch_overhead_s=0.040)
    terms = plan_fetch("w0", tiny.block_hashes, held, 1, slow, lambda w: True)
    assert (terms.decision, terms.fetch_s, terms.saved_s) == (RECOMPUTE, pytest.approx(0.048), pytest.approx(0.016))
    long = plan_fetch("w0", DOC, held, 8, slow, lambda w: True)  # 128 MB: 64 + 40 ms < 128 ms saved
    assert (long.decision, long.fetch_s) == (FETCH, pytest.approx(0.104))
    # the policy agrees: the idle w0 recomputes the tiny prefix (26 ms) instead of fetching (48 + 10 ms)
    snapshot = colocated([dict(), dict(pending=100, held=frozenset(DOC))])
    choice = prefix_aware(snapshot, tiny, ctx({}, True, slow))
    assert (choice.prefill_slot, choice.ttft_s, choice.terms.fetch_blocks) == (0, pytest.approx(0.026), 0)
    choice = prefix_aware(snapshot, tiny, ctx({}, True, COST))  # without the overhead: fetch, 8 + 10 ms
    assert (choice.prefill_slot, choice.ttft_s, choice.terms.fetch_blocks) == (0, pytest.approx(0.018), 1)


def test_rates_measure_link_overhead_and_host_copies():
    rates = KvRates()
    assert rates.cost(COST) is COST  # nothing measured: the configured model
    rates.observe_link(16_000_000, 0.004)  # 4 GB/s
    assert rates.cost(COST).fetch_bytes_per_s == 4e9 and rates.cost(COST) is rates.cost(COST)
    assert rates.observe_fetch(COST, 16_000_000, 0.044, True) == pytest.approx(0.040)  # 44 ms wall - 4 ms link
    assert rates.observe_fetch(COST, 32_000_000, 0.108, True) == pytest.approx(0.100)  # 108 - 8 ms
    assert rates.overhead_s == pytest.approx(0.070)  # the median of 40 and 100 ms
    assert rates.observe_fetch(COST, 16_000_000, 0.001, True) == 0.0  # faster than the link: no negative overhead
    assert rates.overhead_s == pytest.approx(0.040)
    assert rates.observe_fetch(COST, 0, 1.0, True) is None
    rates.observe_host_copies(10 * 16_000_000, 0.1)
    cost = rates.cost(COST)
    assert (cost.host_copy_bytes_per_s, cost.fetch_overhead_s) == (1.6e9, pytest.approx(rates.overhead_s))
    assert (cost.prefill_s_per_token, cost.same_host_bytes_per_s) == (COST.prefill_s_per_token, COST.same_host_bytes_per_s)


def test_rates_keep_one_model_per_base_until_a_rate_moves():
    """The deployment's model and a TP worker's (a fetch prices at its destination's size) alternate
    on the fetch path: each keeps its own measured copy, and a new measurement refreshes both."""
    rates, other = KvRates(), replace(COST, prefill_s_per_token=5e-4)
    rates.observe_link(16_000_000, 0.004)
    mine, theirs = rates.cost(COST), rates.cost(other)
    assert rates.cost(COST) is mine and rates.cost(other) is theirs  # no rebuild when they alternate
    assert (mine.fetch_bytes_per_s, theirs.fetch_bytes_per_s, theirs.prefill_s_per_token) == (4e9, 4e9, 5e-4)
    rates.observe_link(16_000_000, 0.008)  # 2 GB/s: the EWMA moves both copies
    expected = pytest.approx(4e9 + rates.weight * (2e9 - 4e9))
    assert rates.cost(COST).fetch_bytes_per_s == expected and rates.cost(other).fetch_bytes_per_s == expected


def test_the_index_keeps_each_worker_s_host_tier_subset():
    index = KvIndex(max_entries=6)
    a, b, c, d = 11, 12, 13, 14
    index.apply("w0", 1, KvDelta(1, ((K.STORED, a, T.DEVICE),), True))
    index.apply("w0", 1, KvDelta(4, ((K.STORED, b, T.DEVICE), (K.DEMOTED, a, T.HOST), (K.STORED, c, T.HOST))))
    assert index.host_held("w0") == {a, c} and index.host_workers == {"w0"}
    index.apply("w0", 1, KvDelta(6, ((K.PROMOTED, a, T.DEVICE), (K.REMOVED, c, T.HOST))))
    assert index.host_held("w0") == set() and index.host_workers == set() and index.held("w0") == {a, b}
    index.apply("w0", 1, KvDelta(7, ((K.DEMOTED, b, T.HOST),)))
    index.apply("w0", 1, KvDelta(9, ((K.STORED, b, T.DEVICE), (K.STORED, d, T.HOST))))  # recomputed: device again
    assert index.host_held("w0") == {d}
    index.check_invariants()
    index.apply("w0", 1, KvDelta(20, ((K.STORED, a, T.HOST), (K.STORED, c, T.DEVICE)), True))  # a resync
    assert index.held("w0") == {a, c} and index.host_held("w0") == {a}
    index.replace("w1", 1, range(100, 106))  # past the bound: w0's entries go first (LRU), host ones too
    assert index.host_held("w0") == set() and index.host_workers == set()
    index.check_invariants()
    index.apply("w1", 1, KvDelta(1, ((K.STORED, 1, T.HOST),), True))
    index.retire("w1", 1)
    assert index.host_workers == set() and index.host_held("w1") == frozenset()
    index.check_invariants()


def _reference(snapshot, request, host, held, hosts, sharing):
    """Per worker, plain loops: queue + promotion of its own hit's host blocks + plan_fetch's fetch
    (when sharing and it says FETCH) + prefill of the rest."""
    bs, usable, best = COST.block_size_tokens, (request.prompt_tokens - 1) // 16, None
    ids = [f"w{i}" for i in range(len(held))]
    for i, wid in enumerate(ids):
        own = leading_run(request.block_hashes[:usable], held[i])
        promote = COST.promote_s(sum(1 for k in request.block_hashes[:own] if k in host.get(wid, ())))
        hit, fetch_s = own, 0.0
        if sharing:
            terms = plan_fetch(wid, request.block_hashes, dict(zip(ids, held)), usable, COST,
                               lambda w: hosts[int(w[1:])] == hosts[i])
            if terms.decision == FETCH:
                hit, fetch_s = terms.remote_blocks, terms.fetch_s
        ttft = COST.queue_s(snapshot.prefill.pending_tokens[i]) + promote + fetch_s + COST.prefill_s(request.prompt_tokens - hit * bs)
        if best is None or ttft < best[1] - 1e-12:
            best = (i, ttft)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_random_clusters_match_the_per_worker_reference(seed):
    rng = random.Random(seed)
    n, sharing = rng.randrange(2, 6), bool(seed % 2)
    hosts = [f"h{rng.randrange(2)}" for _ in range(n)]
    held = [set(DOC[: rng.randrange(0, 9)]) for _ in range(n)]
    host = {f"w{i}": frozenset(k for k in held[i] if rng.random() < 0.5) for i in range(n)}
    snapshot = colocated([dict(host=hosts[i], pending=rng.randrange(0, 300), held=frozenset(held[i])) for i in range(n)])
    choice = prefix_aware(snapshot, LONG, ctx(host, sharing))
    slot, ttft = _reference(snapshot, LONG, host, held, hosts, sharing)
    assert choice.ttft_s == pytest.approx(ttft, rel=1e-9, abs=1e-12)
    t = choice.terms
    assert t.ttft_s == choice.ttft_s and t.queue_s + t.host_s + t.fetch_s + t.prefill_s == pytest.approx(ttft)
    assert t.host_blocks == sum(1 for k in DOC[: choice.prefill_hit_blocks] if k in host[f"w{choice.prefill_slot}"])


def test_the_router_prices_a_demoted_prefix_from_block_events():
    router = Router(RouterConfig(Mode.COLOCATED, MODEL, ABI, policy="prefix", cost=COST, ttft_slo_s=10.0, tpot_slo_s=1.0))
    for w in ("w0", "w1"):
        router.register(WorkerInfo(w, "h0", Role.COLOCATED, 1, 1000, MODEL, ABI))
        router.report_load(w, 1, WorkerLoad(0, 0, 1000))
        router.report_kv(w, 1, KvDelta(8, tuple((K.STORED, k, T.DEVICE) for k in DOC), True))
    router.report_kv("w0", 1, KvDelta(16, tuple((K.DEMOTED, k, T.HOST) for k in DOC)))  # w0's copy went to host memory
    plan = router.route(LONG)
    assert plan.prefill_id == "w1" and plan.prefix_terms.host_blocks == 0 and plan.predicted_ttft_s == pytest.approx(0.010)
    router.report_load("w1", 1, WorkerLoad(200, 0, 1000))  # w1's queue: 200 ms
    plan2 = router.route(RouteRequest("again", LONG.prompt_tokens, 10, block_hashes=DOC))
    assert plan2.prefill_id == "w0" and plan2.prefix_terms.host_blocks == 8
    assert plan2.prefix_terms.host_s == pytest.approx(0.080)
    router.complete(plan.request_id)
    router.complete(plan2.request_id)
    router.assert_no_leaks()


def test_bench_router_s_event_flow_keeps_the_index_in_step():
    """The synthetic block events bench-router feeds (every kind a host tier produces) leave the
    index holding exactly the flow's device + host blocks, its host subset the flow's host tier."""
    _, workload = random_router(3, 2, 2, "prefix")
    held = {"a": frozenset(workload.documents[0]), "b": frozenset()}
    flow, index, rng, kinds = EventFlow(held, workload, 16), KvIndex(), random.Random(5), set()
    for w, keys in held.items():
        index.replace(w, 1, keys)
    for step in range(60):
        w = "ab"[step % 2]
        delta = flow.report(rng, w)
        kinds |= {kind for kind, _, _ in delta.events}
        index.apply(w, 1, delta)
        assert index.held(w) == set(flow.held[w]) | set(flow.host[w]) and index.host_held(w) == set(flow.host[w])
    assert kinds == {K.STORED, K.REMOVED, K.DEMOTED, K.PROMOTED}
    index.check_invariants()


def test_one_fetch_stuck_behind_a_busy_holder_neither_dominates_nor_locks_fetch_out():
    now = [0.0]
    rates = KvRates(window=4, max_age_s=60.0, clock=lambda: now[0])
    rates.observe_link(16_000_000, 0.008)  # 2 GB/s
    rates.observe_fetch(COST, 16_000_000, 3.808, True)  # 3.8 s waiting for the holder's step
    held = {"w0": set(), "w1": set(DOC)}
    assert plan_fetch("w0", DOC, held, 8, rates.cost(COST), lambda w: True).decision == RECOMPUTE  # 3.8 + 0.064 > 0.128
    now[0] = 61.0  # no fetch ran since: the sample ages out, the next fetch is planned and re-measures
    assert rates.overhead_s is None and rates.cost(COST).fetch_overhead_s == COST.fetch_overhead_s
    assert plan_fetch("w0", DOC, held, 8, rates.cost(COST), lambda w: True).decision == FETCH
    for wall in (3.808, 0.048, 0.058):  # an outlier among ordinary fetches: the median sheds it
        rates.observe_fetch(COST, 16_000_000, wall, True)
    assert rates.overhead_s == pytest.approx(0.050)
    assert plan_fetch("w0", DOC, held, 8, rates.cost(COST), lambda w: True).fetch_s == pytest.approx(0.064 + 0.050)


def test_measured_rates_apply_only_to_a_fitted_cost_model():
    """Placeholder prefill terms (a GPU's) against this machine's measured fetch would call every
    fetch too slow: an unfitted model keeps its own placement terms."""
    rates = KvRates()
    rates.observe_link(16_000_000, 0.016)  # 1 GB/s
    rates.observe_fetch(COST, 16_000_000, 0.056, True)  # 56 ms wall - 16 ms link
    placeholder = replace(COST, fitted=False)
    assert rates.cost(placeholder) is placeholder and rates.cost(COST).fetch_overhead_s == pytest.approx(0.040)
