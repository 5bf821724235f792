"""TetriInfer admission's pure parts: the reserve policy's hold, the ledger's growth grants, the
power-of-two decode choice against a plain reference, and the router composing p2c with --policy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.sequence import SamplingParams
from pdserve.predictor.features import FeatureSpec
from pdserve.predictor.manifest import LengthPredictor, Manifest, Prediction
from pdserve.predictor.softmax import SoftmaxModel
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.router import Router
from pdserve.router.state.reservations import HoldRequest, ReservationLedger
from pdserve.router.tetri.decode_choice import HeavyLight, p2c_slot
from pdserve.router.tetri.reserve_mode import ReservePolicy, outcome_bytes
from pdserve.workers.hold_watch import HoldWatch, hold_params

BUCKETS = (0, 32, 64, 128, 1 << 20)


def constant_predictor(bucket: int) -> LengthPredictor:
    """A predictor that always answers `bucket` (its bias decides; the weights are zero)."""
    spec = FeatureSpec(dim=8)
    bias = np.zeros(len(BUCKETS) - 1, np.float32)
    bias[bucket] = 1.0
    manifest = Manifest("m", "id", "tok", {}, 4096, BUCKETS, spec)
    return LengthPredictor(manifest, SoftmaxModel(np.zeros((spec.width, len(BUCKETS) - 1), np.float32), bias))


def test_static_holds_max_tokens_and_dynamic_the_predicted_bound_capped_by_max_tokens():
    assert ReservePolicy().hold((1, 2, 3), 1024).tokens == 1024
    dynamic = ReservePolicy("dynamic", constant_predictor(1))
    hold = dynamic.hold((1, 2, 3), 1024)
    assert (hold.tokens, hold.prediction, hold.heavy) == (64, Prediction(1, 32, 64), False)
    assert dynamic.hold((1, 2, 3), 40).tokens == 40
    assert ReservePolicy("dynamic", constant_predictor(3), heavy_tokens=256).hold((1,), 1024).heavy
    assert ReservePolicy("static", constant_predictor(1)).hold((1,), 1024).tokens == 1024  # predicted, not used
    with pytest.raises(ValueError, match="needs --predictor"):
        ReservePolicy("dynamic")
    with pytest.raises(ValueError, match="--reserve"):
        ReservePolicy("sometimes")


def test_outcome_bytes_use_the_bucket_bounds():
    pred = Prediction(1, 32, 64)
    assert outcome_bytes(40, pred, BUCKETS, 10) == ("covered", 0, 240)
    assert outcome_bytes(100, pred, BUCKETS, 10) == ("under", 360, 0)
    assert outcome_bytes(10, pred, BUCKETS, 10) == ("over", 0, 540)


def test_ledger_growth_is_an_applied_grant_released_with_the_route():
    ledger = ReservationLedger()
    free = {"p0": 50, "d0": 50}
    ledger.reserve("r1", HoldRequest("p0", 1, 3), HoldRequest("d0", 1, 6, seqs=1), free)
    ledger.apply_ack("d0", 1)
    assert ledger.grow("r1", "d0", 2) is not None and ledger.grow("r1", "d0", 1) is not None
    assert ledger.held_blocks("r1") == 9
    assert "d0" not in ledger.in_flight()  # the worker took the blocks before reporting: never in flight
    assert ledger.grow("r1", "p0", 1) is None and ledger.grow("nope", "d0", 1) is None  # not its decode worker
    ledger.publish("r1")
    assert ledger.held_blocks("r1") == 9
    ledger.check_invariants()
    ledger.release("r1")
    ledger.assert_no_leaks()
    assert ledger.num_granted == ledger.num_released == 4


def test_growth_of_a_dropped_worker_route_is_released_once():
    ledger = ReservationLedger()
    ledger.reserve("r1", None, HoldRequest("d0", 1, 6, seqs=1), {"d0": 50})
    ledger.grow("r1", "d0", 4)
    assert ledger.drop_worker("d0") == ["r1"]
    ledger.assert_no_leaks()


def reference_p2c(names, headroom, need, heavy, light, request_heavy, picks):
    """The spec's route with plain loops: alpha = workers with room; two picks; lower ratio after
    admission, then fewer live decodes, then name."""
    alpha = [s for s in range(len(names)) if headroom[s] >= need[s]]
    if not alpha:
        return None
    if len(alpha) == 1:
        return alpha[0]
    a, b = alpha[picks[0] % len(alpha)], alpha[picks[1] % len(alpha)]
    if a == b:
        b = alpha[(picks[0] + 1) % len(alpha)]
    best = None
    for s in (a, b):
        h, l_ = heavy[s] + request_heavy, light[s] + (not request_heavy)
        key = (h / l_ if l_ else float("inf"), heavy[s] + light[s], names[s])
        if best is None or key < best[0]:
            best = (key, s)
    return best[1]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_p2c_matches_the_reference(data):
    n = data.draw(st.integers(1, 6))
    names = [f"d{i}" for i in range(n)]
    ints = st.lists(st.integers(0, 9), min_size=n, max_size=n)
    headroom, need, heavy, light = (data.draw(ints) for _ in range(4))
    request_heavy = data.draw(st.booleans())
    picks = (data.draw(st.integers(0, 1 << 20)), data.draw(st.integers(0, 1 << 20)))
    got = p2c_slot(names, headroom, need, heavy, light, request_heavy, picks)
    assert got == reference_p2c(names, headroom, need, heavy, light, request_heavy, picks)
    if got is not None:
        assert headroom[got] >= need[got]


def test_p2c_prefers_the_worker_whose_heavy_to_light_ratio_stays_lower():
    # d0 already decodes 3 heavy and 1 light, d1 1 heavy and 3 light: a heavy request goes to d1
    slot = p2c_slot(["d0", "d1"], [9, 9], [1, 1], [3, 1], [1, 3], True, (0, 1))
    assert slot == 1
    assert p2c_slot(["d0", "d1"], [0, 9], [1, 1], [0, 5], [0, 0], True, (0, 0)) == 1  # the only one with room
    assert p2c_slot(["d0", "d1"], [0, 0], [1, 1], [0, 0], [0, 0], True, (0, 1)) is None
    assert p2c_slot(["d0", "d1"], [9, 9], [1, 1], [0, 0], [4, 2], False, (0, 1)) == 1  # all light: the less loaded


def make_router(decode_choice: str, decodes=("d0", "d1")):
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="round_robin", decode_choice=decode_choice))
    for wid in ("p0", *decodes):
        role = Role.PREFILL if wid.startswith("p") else Role.DECODE
        router.register(WorkerInfo(wid, "h", role, 1, 1000, "m", "abi"))
        router.report_load(wid, 1, WorkerLoad(0, 0, 1000))
    return router


def test_router_p2c_balances_heavy_and_light_and_keeps_the_policys_prefill_side():
    router = make_router("p2c")
    plans = []
    for i in range(12):
        plan = router.route(RouteRequest(f"r{i}", 32, 512 if i % 2 else 32, heavy=bool(i % 2)))
        assert isinstance(plan, RoutePlan) and plan.prefill_id == "p0"
        plans.append(plan)
    counts = {w: router.heavy_light(w) for w in ("d0", "d1")}
    assert sum(h for h, _ in counts.values()) == 6 and sum(l_ for _, l_ in counts.values()) == 6
    assert all(h >= 1 and l_ >= 1 for h, l_ in counts.values())  # neither worker takes only one kind
    for plan in plans:
        router.complete(plan.request_id)
    assert router.heavy_light("d0") == router.heavy_light("d1") == (0, 0)
    router.assert_no_leaks()
    with pytest.raises(ValueError, match="decode choice"):
        Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", decode_choice="random"))


def test_heavy_light_book_counts_live_routes():
    book = HeavyLight()
    book.add("a", "d0", True)
    book.add("b", "d0", False)
    book.add("a", "d1", True)  # re-added elsewhere: moves
    assert (book.counts("d0"), book.counts("d1"), len(book)) == ((0, 1), (1, 0), 2)
    book.remove("a")
    book.remove("a")
    assert book.counts("d1") == (0, 0)


class _Seq:
    def __init__(self, blocks, preemptions=0):
        self.block_table, self.num_preemptions = list(range(blocks)), preemptions


class _Engine:
    def __init__(self):
        self.seqs = {}


def test_hold_watch_reports_cumulative_growth_and_preemptions_until_the_step_after_finish():
    params = SamplingParams(max_tokens=1024)
    assert hold_params(params, 0) is params and hold_params(params, 2048) is params
    assert hold_params(params, 64).max_tokens == 64
    eng, watch = _Engine(), HoldWatch()
    watch.watch("r", hold_blocks=6)
    eng.seqs["r"] = _Seq(6)
    watch.after_step(eng, [])
    assert watch.counts("r") == (0, 0)
    eng.seqs["r"] = _Seq(8)
    watch.after_step(eng, [])
    eng.seqs["r"] = _Seq(0, preemptions=1)  # preempted: blocks freed, the growth stays counted
    watch.after_step(eng, [])
    assert watch.counts("r") == (2, 1) and (watch.num_growths, watch.num_preemptions) == (1, 1)
    eng.seqs["r"] = _Seq(9, preemptions=1)
    watch.after_step(eng, ["r"])
    assert watch.counts("r") == (3, 1)  # still readable for the finishing step's token message
    del eng.seqs["r"]
    watch.after_step(eng, [])
    assert watch.counts("r") == (0, 0) and len(watch) == 0
