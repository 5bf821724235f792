"""Queueing, goodput, placement and Splitwise ledgers."""

from __future__ import annotations


import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.ledger import (
    attainment,
    inter_op_ttft_s,
    intra_op_ttft_s,
    joint_attainment,
    md1_ttft_s,
    md1_wait_s,
    phase_goodput,
    replica_count,
    system_goodput,
    system_goodput_per_gpu,
    two_slo_goodput,
)
from pdserve.ledger.goodput import best_per_gpu
from pdserve.ledger.placement import StageSlot, fits_on_gpus, link_feasible, payload_demand_bytes_per_s, stage_packing_violations
from pdserve.ledger.splitwise import (
    RoleState,
    WorkerLoad,
    admits_assignment,
    choose_mixed_phase,
    enter_mixed,
    fcfs_prompt_batch,
    jsq_by_pending_tokens,
    layer_visibility_s,
    leave_mixed,
    mixed_capacity,
    serialized_completion_s,
    static_capacity_rps,
)

GIB, MIB = 1 << 30, 1 << 20


def test_md1_closed_form():
    assert md1_ttft_s(5.0, 0.1) == pytest.approx(0.1 + 5 * 0.01 / (2 * 0.5))
    assert inter_op_ttft_s(5.0, 0.1) == pytest.approx(0.1 + 5 * 0.01 / (4 * 1.5))
    assert intra_op_ttft_s(5.0, 0.1, 1.5) == pytest.approx(0.1 / 1.5 + 5 * 0.01 / (3 * 1.0))
    with pytest.raises(ValueError, match="unstable"):
        md1_ttft_s(10.0, 0.1)
    with pytest.raises(ValueError):
        intra_op_ttft_s(1.0, 0.1, 2.5)


@given(st.floats(0.001, 1.0), st.floats(0.0, 0.99), st.floats(0.0, 0.99))
def test_md1_grows_with_load(service_s, u1, u2):
    lo, hi = sorted((u1, u2))
    assert md1_ttft_s(lo / service_s, service_s) <= md1_ttft_s(hi / service_s, service_s) + 1e-12
    assert md1_wait_s(lo / service_s, service_s) >= 0


@given(st.floats(0.001, 1.0), st.floats(0.0, 0.99))
def test_pipeline_queues_less_than_one_device(service_s, load):
    rate = load / service_s
    assert inter_op_ttft_s(rate, service_s) <= md1_ttft_s(rate, service_s) + 1e-12


def test_attainment_and_goodput():
    assert attainment([0.1, 0.2, 0.3, 0.4], 0.25) == 0.5
    samples = {2.0: [0.1] * 10, 4.0: [0.1] * 9 + [0.9], 6.0: [0.1] * 5 + [0.9] * 5}
    assert phase_goodput(samples, 0.25, 0.9) == 4.0
    assert phase_goodput(samples, 0.25, 0.95) == 2.0
    assert phase_goodput({1.0: [1.0]}, 0.25, 0.9) == 0.0
    tpot = {2.0: [0.05] * 10, 4.0: [0.5] * 10, 6.0: [0.05] * 10}
    assert two_slo_goodput(samples, tpot, 0.25, 0.1, 0.9) == 2.0


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=30))
def test_joint_attainment_below_marginals(pairs):
    ttft, tpot = [p[0] for p in pairs], [p[1] for p in pairs]
    joint = joint_attainment(ttft, tpot, 0.5, 0.5)
    assert joint <= min(attainment(ttft, 0.5), attainment(tpot, 0.5))


def test_distserve_replicas_and_capacity():
    n_p, n_d = replica_count(10, 8), replica_count(10, 12)
    assert (n_p, n_d) == (2, 1)
    system = system_goodput(n_p * 8, n_d * 12)
    assert system == 12 and system_goodput_per_gpu(system, 4, 2) == 2
    assert best_per_gpu([("P-tp2", 8, 2), ("P-tp4", 12, 4)])[0] == "P-tp2"
    with pytest.raises(ValueError):
        best_per_gpu([("x", 0.0, 1)])


@given(st.floats(0.1, 1000), st.floats(0.1, 100))
def test_replicas_cover_target(target, goodput):
    n = replica_count(target, goodput)
    assert n * goodput >= target * (1 - 1e-9)
    assert (n - 1) * goodput < target


def test_payload_demand_and_links():
    demand = payload_demand_bytes_per_s(12, 64 * MIB)
    assert demand == 768 * MIB
    assert link_feasible(demand, 4 * GIB) and not link_feasible(demand, 256 * MIB)
    assert fits_on_gpus(132 * GIB, 2, 80 * GIB) and not fits_on_gpus(132 * GIB, 1, 80 * GIB)


def test_stage_packing():
    slots = [StageSlot(i, p, s, f"n{s}") for i, p in (("P0", "prefill"), ("P1", "prefill"), ("D0", "decode")) for s in (0, 1)]
    assert stage_packing_violations(slots, 2, 4) == []
    assert stage_packing_violations(slots, 2, 2) == ["node n0 uses 3 GPUs of 2", "node n1 uses 3 GPUs of 2"]


def test_splitwise_capacity_and_batching():
    assert static_capacity_rps(2, 6, 2, 4) == 8
    mixed = mixed_capacity(2, 6, 2, 4, 1, 4)
    assert (mixed.prompt_side_rps, mixed.token_side_rps, mixed.system_rps) == (10, 12, 10)
    assert fcfs_prompt_batch([1000, 700, 600], 2048) == 2
    assert fcfs_prompt_batch([3000, 10], 2048) == 1
    assert fcfs_prompt_batch([], 2048) == 0


@given(st.lists(st.integers(1, 3000), max_size=12), st.integers(1, 5000))
def test_fcfs_batch_is_a_prefix_under_the_cap(queue, cap):
    k = fcfs_prompt_batch(queue, cap)
    assert sum(queue[:k]) <= cap or k == 1
    if k < len(queue):
        assert sum(queue[: k + 1]) > cap


def test_jsq_uses_pending_tokens_and_headroom():
    workers = [WorkerLoad("a", 100, 10), WorkerLoad("b", 300, 1000), WorkerLoad("c", 300, 1000)]
    assert jsq_by_pending_tokens(workers).name == "a"
    assert jsq_by_pending_tokens(workers, need_kv_bytes=500).name == "b"
    assert jsq_by_pending_tokens(workers, need_kv_bytes=5000) is None


def test_preemption_guard():
    assert choose_mixed_phase(True, 10, 0, 500, 3) == "prompt"
    assert choose_mixed_phase(True, 600, 0, 500, 3) == "token"
    assert choose_mixed_phase(True, 10, 3, 500, 3) == "token"
    assert choose_mixed_phase(False, 10, 0, 500, 3) == "token"


def test_layer_visibility_example():
    ready, xfer = [25, 50, 75, 100], [10, 10, 10, 10]
    assert layer_visibility_s(ready, xfer) == [35, 60, 85, 110]
    assert serialized_completion_s(ready, xfer) == 140


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 20)), min_size=1, max_size=10))
def test_streaming_never_later_than_serialized(layers):
    ready = sorted(r for r, _ in layers)
    xfer = [x for _, x in layers]
    visible = layer_visibility_s(ready, xfer)
    assert visible[-1] <= serialized_completion_s(ready, xfer) + 1e-9
    assert visible[-1] >= max(ready[-1] + xfer[-1], sum(xfer)) - 1e-9
    assert all(v >= r + x - 1e-9 for v, r, x in zip(visible, ready, xfer))


def test_role_epochs():
    mixed = enter_mixed(RoleState("TOKEN", 12))
    back = leave_mixed(mixed)
    assert (mixed.role, mixed.epoch, mixed.origin) == ("MIXED", 13, "TOKEN")
    assert (back.role, back.epoch) == ("TOKEN", 14)
    assert admits_assignment(mixed, 13) and not admits_assignment(mixed, 12)
    with pytest.raises(ValueError):
        enter_mixed(mixed)
    with pytest.raises(ValueError):
        leave_mixed(back)
