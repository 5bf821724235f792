"""KV-Runahead, TetriInfer, MemServe/Mooncake, net margin, release and transfer-timing ledgers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.ledger import kvmemory, runahead, tetri
from pdserve.ledger.margin import MarginTerms, net_margin_s, should_enable_pd
from pdserve.ledger.release import ROLLBACK_ORDER, authorization_error, release_path_error, rollback_order_error
from pdserve.ledger.transfer import CreditHold, exposed_stall_s, overlapped_work_s, peak_inflight_bytes, union_length_s

partitions = st.lists(st.integers(1, 200), min_size=1, max_size=8)


@given(partitions)
def test_dense_block_sum_closed_form(part):
    total = sum(part)
    assert sum(runahead.dense_block_work(part)) == (total * total + sum(n * n for n in part)) // 2
    assert sum(runahead.dense_block_work(part)) == runahead.dense_block_total(part)


@given(partitions)
def test_triangular_sum_is_all_causal_pairs(part):
    total = sum(part)
    assert sum(runahead.triangular_work(part)) == total * (total + 1) // 2
    assert all(t <= d for t, d in zip(runahead.triangular_work(part), runahead.dense_block_work(part)))


@given(st.integers(1, 500), st.integers(1, 16))
def test_equal_kvr_traffic_is_half_of_tsp(rows, procs):
    assert runahead.kvr_equal_token_rows(rows, procs) * 2 == runahead.tsp_token_rows(rows, procs)
    part = runahead.equal_partition(rows * procs, procs)
    assert sum(runahead.prefix_sums_sent(part)) == runahead.kvr_equal_token_rows(rows * procs, procs)


def test_runahead_example():
    assert runahead.prefix_sums_sent([40, 32, 24]) == [40, 72]
    assert runahead.kvr_traffic_bytes([40, 32, 24], 4, 4096) == 1_835_008
    assert runahead.kvr_equal_token_rows(96, 3) == 96 and runahead.tsp_token_rows(96, 3) == 192
    assert max(runahead.dense_block_work([40, 32, 24])) < max(runahead.dense_block_work([32, 32, 32]))


def test_tetri_buckets_and_gates():
    bounds = [0, 200, 400, 600]
    assert tetri.bucket_of(450, bounds) == 2 and tetri.bucket_of(0, bounds) == 0
    with pytest.raises(ValueError):
        tetri.bucket_of(600, bounds)
    assert tetri.reservation_bounds_bytes(2, bounds, 1024) == (400 * 1024, 600 * 1024)
    assert [tetri.prediction_outcome(n, 1, bounds) for n in (250, 400, 100)] == ["covered", "under", "over"]
    assert not tetri.reserve_static_admits(600, 500, 1000)
    assert tetri.reserve_dynamic_admits(600, 200, 500, 1000)


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_dynamic_gate_admits_whatever_static_admits(used, short, new, cap):
    if tetri.reserve_static_admits(used, new, cap):
        assert tetri.reserve_dynamic_admits(used, short, new, cap)


def test_power_of_two_prefers_lower_heavy_ratio():
    a, b = tetri.DecodeWorker("a", 10, 1, 3), tetri.DecodeWorker("b", 10, 0, 1)
    assert tetri.power_of_two_choice(a, b, request_is_heavy=True).name == "a"
    assert tetri.power_of_two_choice(a, b, request_is_heavy=False).name == "b"


def test_call_geometry_and_hash_chain():
    assert [tuple(vars(kvmemory.call_geometry(4, m)).values()) for m in kvmemory.CALL_MODES] == [(8, 8), (1, 8), (1, 1)]
    chain = kvmemory.prefix_hash_chain("model-a", [[1, 2], [3, 4]])
    assert chain[0] == kvmemory.prefix_hash_chain("model-a", [[1, 2]])[0]
    assert chain[1] != kvmemory.prefix_hash_chain("model-a", [[3, 4]])[0]  # same tokens, other prefix
    assert chain != kvmemory.prefix_hash_chain("model-b", [[1, 2], [3, 4]])


def test_mooncake_route_prefers_short_queue_and_rejects_early():
    costs = [
        kvmemory.prefill_cost(kvmemory.PrefillCandidate(name, q, p), 8, 8, 0.010, 0.002, 2)
        for name, q, p in (("P0", 0.040, 0), ("P1", 0.010, 2), ("P2", 0.060, 8))
    ]
    assert [round(c.best_s, 6) for c in costs] == [0.056, 0.022, 0.060]
    ok = kvmemory.route_or_reject(costs, {"D0": 0.080, "D1": 0.095}, 0.1, 0.1)
    assert (ok.admitted, ok.prefill, ok.decode) == (True, "P1", "D0")
    overload = kvmemory.route_or_reject(costs, {"D0": 0.120}, 0.1, 0.1)
    assert not overload.admitted and overload.prefill is None and "TBT" in overload.reason


@given(st.integers(1, 64), st.data())
def test_remote_path_never_prices_above_local_when_transfer_is_cheaper(blocks, data):
    p_i = data.draw(st.integers(0, blocks))
    p_star = data.draw(st.integers(p_i, blocks))
    cost = kvmemory.prefill_cost(kvmemory.PrefillCandidate("x", 0.0, p_i), blocks, p_star, 0.01, 0.002, 1)
    assert cost.best_s <= cost.local_s
    if cost.remote_s is not None:
        assert cost.remote_s <= cost.local_s


def test_net_margin():
    good = MarginTerms(0.042, 0.006, 0.002, 0.001)
    assert net_margin_s(good) == pytest.approx(0.033)
    assert should_enable_pd(good, 0.005, True, True)
    assert not should_enable_pd(good, 0.005, True, False)
    assert not should_enable_pd(MarginTerms(0.042, 0.038, 0.002, 0.003), 0.005, True, True)


def test_release_paths_and_rollback_order():
    assert release_path_error(["PINNED", "SHADOW", "CANARY", "ACTIVE", "ROLLING_BACK", "ROLLED_BACK"]) is None
    assert "SHADOW -> ACTIVE" in release_path_error(["PINNED", "SHADOW", "ACTIVE"])
    assert rollback_order_error(list(ROLLBACK_ORDER)) is None
    assert "step 8" in rollback_order_error(list(ROLLBACK_ORDER[:-1]))
    assert "unexpected" in rollback_order_error(list(ROLLBACK_ORDER) + ["STOP_NEW_ROUTES"])


def test_capability_subset_and_bytes():
    cap = {"signature_valid": True, "issuer": "cp", "expires_at_s": 10, "route_epoch": 1, "allowed_regions": ["r1", "r2"], "max_bytes": 100,
           "tenant": "t", "source": "P", "destination": "D", "transfer_id": "x", "generation": 1, "cache_abi": "a", "direction": "write", "nonce": "n"}
    req = {k: cap[k] for k in ("tenant", "source", "destination", "transfer_id", "generation", "cache_abi", "direction", "nonce")}
    ok = {**req, "regions": ["r1"], "bytes": 100}
    assert authorization_error(ok, cap, 0, 1, ["cp"], 60) is None
    assert "outside" in authorization_error({**ok, "regions": ["r3"]}, cap, 0, 1, ["cp"], 60)
    assert "bytes" in authorization_error({**ok, "bytes": 0}, cap, 0, 1, ["cp"], 60)
    assert "epoch" in authorization_error(ok, cap, 0, 2, ["cp"], 60)
    assert "lifetime" in authorization_error(ok, cap, 11, 1, ["cp"], 60)


def test_credit_peak_and_overlap():
    holds = [CreditHold(0, 10, 1024), CreditHold(1, 20, 1024), CreditHold(10, 15, 1024)]
    assert peak_inflight_bytes(holds) == 2048  # release at 10 frees before the acquire at 10
    assert union_length_s([(0, 100), (60, 70), (70, 134), (100, 164)]) == 164
    assert overlapped_work_s([(0, 100), (60, 70), (70, 134), (100, 164)]) == 74
    assert exposed_stall_s(200, 140) == 60 and exposed_stall_s(100, 140) == 0


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 50)), max_size=12))
def test_overlap_is_zero_for_serial_work_and_never_negative(pairs):
    spans = [(s, s + d) for s, d in pairs]
    assert overlapped_work_s(spans) >= -1e-9
    serial, t = [], 0.0
    for _, d in pairs:
        serial.append((t, t + d))
        t += d
    assert abs(overlapped_work_s(serial)) <= 1e-6
