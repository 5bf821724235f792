"""A served TP worker's collectives priced from its rank 0's own steps (router/pricing/live_collectives.py):
the fold's exact numbers, a worker whose steps show slower collectives priced higher in both
phases exactly as the one formula (TpScaling.price) says, TP 1 workers untouched, bad windows
ignored and counted, the report's wire form (engine/tp_tally.py, workers/messages.Load)."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest

from pdserve.engine.tp_tally import CollectiveReport, CollectiveTally, PhaseCollectives
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
from pdserve.router.policy.live_pricing import LivePricing
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.live_collectives import WITHDRAWN, LiveCollectives, PhaseFit
from pdserve.router.pricing.tp_pricing import TpPricing
from pdserve.router.process.frontend import ClusterBackend
from pdserve.router.process.metrics import RuntimeMetrics
from pdserve.router.router import Router
from pdserve.workers import messages as m

# measured at TP 1: prefill 10 ms + 1 ms/token, decode 20 ms + 1 ms/seq; 4 layers: K = 8 all_reduces a step of
# B = 1000-byte rows; the profile's TP 2: 1 ms a call, 1 ns/byte, 2 ms sync (the pricing test's fixtures)
from tests.router.pricing.test_tp_worker_pricing import BASE, PRICING

# the profile's o at TP 2: 8 x 1 ms + 2 ms = 10 ms a step, 8 x 1000 x 1 ns = 8 us a row
PROFILE_SLOPE = 8e-6


def window(steps: int, rows: int, reduce_s: float, broadcast_s: float) -> PhaseCollectives:
    """`steps` steps of rows / steps rows each, reduce_s / steps seconds each."""
    if steps <= 0:
        return PhaseCollectives(steps, rows, reduce_s, broadcast_s)
    return PhaseCollectives(steps, rows, reduce_s, broadcast_s, rows * rows // steps, rows * reduce_s / steps)


def prefill(*args) -> CollectiveReport:
    return CollectiveReport(prefill=window(*args))


def decode(*args) -> CollectiveReport:
    return CollectiveReport(decode=window(*args))


# a loaded prefill: all_reduces 20 ms a step + 0.1 ms a token (the profile: 8 ms + 8 us), broadcast 2 ms
SLOW_PREFILL = (prefill(4, 400, 4 * (0.02 + 100 * 1e-4), 0.008), prefill(4, 1200, 4 * (0.02 + 300 * 1e-4), 0.008))
# a steady 4-sequence decode batch: 12 ms in all_reduce, 1 ms broadcast a step
SLOW_DECODE = decode(10, 40, 0.12, 0.01)


def test_the_fold_keeps_decayed_weighted_sums_and_fits_their_line():
    keep = 0.5 ** (4 / 32)  # four newer steps age the first window's (half-life 32 steps)
    fit = PhaseFit().folded(SLOW_PREFILL[0].prefill, 32.0).folded(SLOW_PREFILL[1].prefill, 32.0)
    assert fit.num_steps == 8
    assert fit.weight == pytest.approx(4 * keep + 4, rel=1e-15)
    assert fit.rows == pytest.approx(400 * keep + 1200, rel=1e-15)
    assert fit.rows_sq == pytest.approx(400 ** 2 / 4 * keep + 1200 ** 2 / 4, rel=1e-15)
    assert fit.reduce_s == pytest.approx(0.12 * keep + 0.2, rel=1e-15)
    assert fit.rows_reduce == pytest.approx(400 * 0.12 / 4 * keep + 1200 * 0.2 / 4, rel=1e-15)
    assert fit.sync_s() == pytest.approx(0.002, rel=1e-14)
    # the two points lie on a = 20 ms, b = 0.1 ms a row, whatever their weights
    assert fit.line(PROFILE_SLOPE) == pytest.approx((0.02, 1e-4), rel=1e-9)
    # three uneven points: the weighted least squares, by hand
    third = window(2, 400, 2 * 0.05, 0.0)  # (200 rows, 50 ms) of weight 2
    fit3 = fit.folded(third, 32.0)
    k2 = 0.5 ** (2 / 32)
    w, x, y = [4 * keep * k2, 4 * k2, 2], [100, 300, 200], [0.03, 0.05, 0.05]
    n, sx, sy = sum(w), sum(a * b for a, b in zip(w, x)), sum(a * b for a, b in zip(w, y))
    sxx, sxy = sum(a * b * b for a, b in zip(w, x)), sum(a * b * c for a, b, c in zip(w, x, y))
    slope = (sxy - sx * sy / n) / (sxx - sx * sx / n)
    assert fit3.line(PROFILE_SLOPE) == pytest.approx(((sy - slope * sx) / n, slope), rel=1e-9)


def test_one_window_of_steps_of_different_sizes_gives_the_per_step_line():
    tally = CollectiveTally()
    for rows in (100, 300, 200, 50, 400, 100, 250, 300):  # all_reduce 20 ms + 0.1 ms a row, broadcast 1 ms
        tally.add("prefill", rows, 0.02 + 1e-4 * rows, 0.001)
    fit = PhaseFit().folded(tally.take().prefill, 32.0)
    assert fit.line(PROFILE_SLOPE) == pytest.approx((0.02, 1e-4), rel=1e-9) and fit.sync_s() == pytest.approx(0.001)
    inconsistent = [PhaseCollectives(4, 400, 0.1, 0.0, 39_999, 10.0), PhaseCollectives(4, 400, 0.1, 0.0, 160_001, 10.0)]
    live = LiveCollectives(PRICING)
    for w in inconsistent:  # squares below the mean's, or above the whole's
        live.fold("w", 2, CollectiveReport(prefill=w))
    assert live.num_ignored == {"inconsistent": 2}


def test_a_rows_x_seconds_sum_no_steps_could_have_is_inconsistent():
    """sum r y lies in [sum y, rows x sum y] (every step has a row); float rounding passes."""
    live = LiveCollectives(PRICING)
    for rows_reduce_s in (0.1 * (1 - 1e-12), 40.0 * (1 + 1e-12)):  # on the bounds but for rounding: folded
        live.fold("w", 2, CollectiveReport(prefill=PhaseCollectives(4, 400, 0.1, 0.0, 40_000, rows_reduce_s)))
    assert not live.num_ignored and live.view("w")["prefill"]["steps"] == 8
    for rows_reduce_s in (0.099, 40.1):  # below the seconds, above rows x the seconds
        live.fold("w", 2, CollectiveReport(prefill=PhaseCollectives(4, 400, 0.1, 0.0, 40_000, rows_reduce_s)))
    assert live.num_ignored == {"inconsistent": 2} and live.view("w")["prefill"]["steps"] == 8


def test_steady_rows_keep_the_profiles_slope_and_clamp_below_zero():
    fit = PhaseFit().folded(SLOW_DECODE.decode, 32.0)
    a, b = fit.line(PROFILE_SLOPE)  # 4 rows every step: no slope to fit
    assert (a, b) == pytest.approx((0.012 - 4 * PROFILE_SLOPE, PROFILE_SLOPE), rel=1e-12)
    assert fit.line(0.01) == pytest.approx((0.0, 0.12 / 40), rel=1e-12)  # a slope larger than the seconds: through 0
    falling = PhaseFit().folded(window(2, 20, 2 * 0.05, 0), 32.0).folded(window(2, 200, 2 * 0.01, 0), 32.0)
    assert falling.line(PROFILE_SLOPE) == pytest.approx((falling.reduce_s / falling.weight, 0.0), rel=1e-12)


def test_a_worker_whose_steps_show_slower_collectives_is_priced_higher_by_the_formula():
    live = LiveCollectives(PRICING)
    assert live.fold("w", 2, SLOW_PREFILL[0]) is None  # 4 prefill steps: not enough yet
    cost = live.fold("w", 2, SLOW_PREFILL[1])
    prefill_costs = live.live_costs("w", "prefill")
    assert (prefill_costs.allreduce_s, prefill_costs.allreduce_s_per_byte, prefill_costs.step_sync_s) == pytest.approx(
        (0.02 / 8, 1e-4 / 8000, 0.002), rel=1e-9)
    assert live.live_costs("w", "decode") is None and cost == PRICING.worker(2, prefill_costs, None)
    # prefill at TP 2: 0.5 x the measured terms + the live o (20 + 2 ms a step, 0.1 ms a token)
    assert (cost.prefill_overhead_s, cost.prefill_s_per_token) == pytest.approx((0.005 + 0.022, 5e-4 + 1e-4), rel=1e-9)
    profile = PRICING.worker(2)
    assert (profile.prefill_overhead_s, profile.prefill_s_per_token) == pytest.approx((0.015, 5.08e-4), rel=1e-14)
    assert (cost.decode_step_base_s, cost.decode_step_s_per_seq) == (profile.decode_step_base_s, profile.decode_step_s_per_seq)
    cost = live.fold("w", 2, SLOW_DECODE)
    decode_costs = live.live_costs("w", "decode")
    assert cost == PRICING.worker(2, prefill_costs, decode_costs) and live.cost("w") is cost
    # decode at TP 2: 0.75 x the measured terms + (11.968 ms + 1 ms sync) a step, the profile's 8 us a sequence
    assert (cost.decode_step_base_s, cost.decode_step_s_per_seq) == pytest.approx(
        (0.015 + 0.012 - 4 * PROFILE_SLOPE + 0.001, 7.5e-4 + PROFILE_SLOPE), rel=1e-9)
    assert cost.decode_step_base_s > profile.decode_step_base_s and cost.prefill_overhead_s > profile.prefill_overhead_s
    assert live.fold("w", 2, CollectiveReport()) is None and live.cost("w") is cost  # an idle window moves nothing
    view = live.view("w")
    assert view["prefill"]["step_ms"] == pytest.approx(22.0, rel=1e-9) and view["decode"]["steps"] == 10


def test_a_profiled_size_pays_the_live_collectives_over_the_measured_ones():
    measured2 = TpPricing(BASE, PRICING.scaling, measured_tp=2)  # the steps were timed at TP 2
    live = LiveCollectives(measured2)
    cost = live.fold("w", 2, SLOW_DECODE)
    assert measured2.worker(2) == BASE  # without live costs: as measured
    # as measured + the live o - the profile's o: (12.968 - 10) ms a step, 0 a sequence
    assert (cost.decode_step_base_s, cost.decode_step_s_per_seq) == pytest.approx(
        (0.02 + 0.012968 - 0.010, 1e-3), rel=1e-9)


def _router(join: bool = True) -> Router:
    """p1, p2, p3 prefill and d1, d2 decode workers (TP 1, 2, 2, 1, 2); none unless `join`."""
    cost = PRICING.pair(1, 1)
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="slo", cost=cost, pricing=PRICING,
                                 ttft_slo_s=100.0, tpot_slo_s=100.0), clock=lambda: 0.0)
    if not join:
        return router
    for wid, role, tp in (("p1", Role.PREFILL, 1), ("p2", Role.PREFILL, 2), ("p3", Role.PREFILL, 2),
                          ("d1", Role.DECODE, 1), ("d2", Role.DECODE, 2)):
        router.register(WorkerInfo(wid, "h0", role, 1, 10_000, "m", "abi", tp))
        router.report_load(wid, 1, WorkerLoad(1000 if role is Role.PREFILL else 0, 4 if role is Role.DECODE else 0, 10_000))
    return router


def test_the_router_prices_the_reporting_workers_slots_and_leaves_the_others():
    router = _router()
    router.snapshot()
    for report in SLOW_PREFILL:
        router.report_collectives("p2", 1, report)
    router.report_collectives("d2", 1, SLOW_DECODE)
    router.report_collectives("p1", 1, SLOW_DECODE)  # a TP 1 worker's steps: no collectives to price
    router.report_collectives("d1", 1, SLOW_DECODE)
    p2, d2 = router.live.cost("p2"), router.live.cost("d2")
    assert router.worker_cost("p2") is p2 and router.worker_cost("d2") is d2
    assert router.worker_cost("p3") is PRICING.worker(2) and router.worker_cost("p1") is PRICING.worker(1)
    assert router.live.cost("p1") is None and router.live.num_ignored == {"not_tp": 2}
    terms = router.snapshot().derived(router.config.cost)
    # slots p1, p2, p3 and d1, d2: p2 and d2 at their live price, the others as before
    assert terms.queue_p.tolist() == [BASE.queue_s(1000), p2.queue_s(1000), PRICING.worker(2).queue_s(1000)]
    assert terms.prefill_coef.ravel().tolist() == [0.01, p2.prefill_overhead_s, 0.015, 1e-3, p2.prefill_s_per_token, 5.08e-4]
    assert terms.tpot_d.tolist() == [BASE.decode_step_s(5), d2.decode_step_s(5)]
    assert terms.admission_d[1] == d2.admission_delay_s(4) > PRICING.worker(2).admission_delay_s(4)
    # a route's pair: P's live prefill, D's live decode; a local prefill on d2 at d2's (profile) prefill
    pair = router.pair_cost(router.snapshot(), 1, 1)
    assert pair == PRICING.pair(2, 2, (router.live.live_costs("p2", "prefill"), router.live.live_costs("d2", "decode"), None))
    assert (pair.prefill_overhead_s, pair.prefill_s_per_token) == (p2.prefill_overhead_s, p2.prefill_s_per_token)
    assert (pair.decode_step_base_s, pair.decode_step_s_per_seq) == (d2.decode_step_base_s, d2.decode_step_s_per_seq)
    assert pair.at_decode_worker().prefill_s(300) == pytest.approx(PRICING.worker(2).prefill_s(300), rel=1e-12)
    assert router.pair_cost(router.snapshot(), 1, 1) is pair  # cached while neither estimate moves
    assert router.pair_cost(router.snapshot(), 2, 0) is PRICING.pair(2, 1)  # p3 -> d1: neither is live
    # a new epoch starts from the profile again
    router.register(WorkerInfo("p2", "h0", Role.PREFILL, 2, 10_000, "m", "abi", 2))
    router.report_load("p2", 2, WorkerLoad(1000, 0, 10_000))
    assert router.live.cost("p2") is None and router.worker_cost("p2") is PRICING.worker(2) and router.live.num_live == 1
    assert router.pair_cost(router.snapshot(), 1, 1) == PRICING.pair(2, 2, (None, router.live.live_costs("d2", "decode"), None))
    assert router.snapshot().derived(router.config.cost).queue_p.tolist()[1] == PRICING.worker(2).queue_s(1000)
    router.report_collectives("d2", 0, SLOW_DECODE)  # a retired epoch's report: not folded
    assert router.live.cost("d2") is d2


class NotedCosts:
    """The builders' side of `note_cost` (router/state/snapshot.py), recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, CostModel | None]] = []

    def note_cost(self, worker_id: str, cost: CostModel | None) -> None:
        self.calls.append((worker_id, cost))


def test_a_change_of_tp_size_withdraws_the_live_price_from_the_slots():
    notes = NotedCosts()
    prices = LivePricing(PRICING, PRICING.pair(1, 1), (notes,))
    prices.report("w", 2, SLOW_DECODE)
    cost = prices.live.cost("w")
    assert cost is not None and notes.calls == [("w", cost)] and prices.live.num_live == 1
    prices.report("w", 4, SLOW_PREFILL[0])  # the same id at TP 4: 4 prefill steps, not live yet
    assert notes.calls == [("w", cost), ("w", None)] and prices.live.cost("w") is None and prices.live.num_live == 0
    assert prices.live.view("w")["prefill"]["steps"] == 4 and prices.live.view("w")["decode"]["steps"] == 0
    info = WorkerInfo("w", "h0", Role.PREFILL, 2, 10_000, "m", "abi", 4)
    assert prices.worker_cost(info) is PRICING.worker(4)
    prices.report("w", 4, SLOW_PREFILL[1])  # live again, at TP 4
    again = PRICING.worker(4, prices.live.live_costs("w", "prefill"), None)
    assert notes.calls[-1] == ("w", prices.live.cost("w")) == ("w", again)
    live = prices.live  # the fold's own answers: a TP 1 report drops it too; nothing live, nothing withdrawn
    assert live.fold("w", 1, SLOW_DECODE) is WITHDRAWN and live.cost("w") is None and live.num_live == 0
    assert live.fold("w", 2, SLOW_PREFILL[0]) is None and live.fold("w", 3, SLOW_PREFILL[0]) is None


def _gauges(metrics: RuntimeMetrics, worker_id: str) -> dict[tuple[str, str], float]:
    read = metrics.registry.get_sample_value
    values = {(phase, term): read("pdserve_tp_live_collective_seconds", {"worker": worker_id, "phase": phase, "term": term})
              for phase in ("prefill", "decode") for term in ("step", "row")}
    return {key: value for key, value in values.items() if value is not None}


def test_the_gauges_show_only_live_phases_and_go_with_a_retired_or_new_epoch():
    """The router process's backend (router/process/frontend.py) fed Register and Heartbeat messages."""
    dead: list[str] = []
    backend = ClusterBackend(_router(join=False), "test", None, 4096, "tcp://127.0.0.1:*", is_dead=lambda: [dead.pop()] if dead else [])

    def beat(wid: str, epoch: int, report: CollectiveReport) -> None:
        backend.report_load(m.Heartbeat(wid, epoch, m.Load(0, 0, 0, 10_000, 0, num_blocks=10_000, collectives=report)))

    def register(wid: str, epoch: int, role: str) -> None:
        backend._on_register(m.Register(wid, epoch, "h0", role, 0, 10_000, 16, "m", "abi", 64, 4096, tp=2))

    async def scenario() -> None:
        for wid, role in (("p2", "prefill"), ("d2", "decode")):
            register(wid, 1, role)
        for wid, report in (("p2", SLOW_PREFILL[0]), ("p2", SLOW_PREFILL[1]), ("d2", SLOW_DECODE)):
            beat(wid, 1, report)
        prefill = backend.router.live.view("p2")["prefill"]
        assert _gauges(backend.metrics, "p2") == pytest.approx({("prefill", "step"): prefill["step_ms"] / 1e3,
                                                                 ("prefill", "row"): prefill["row_ms"] / 1e3}, rel=1e-15)
        assert set(_gauges(backend.metrics, "d2")) == {("decode", "step"), ("decode", "row")}
        register("p2", 2, "prefill")  # a new epoch: priced from the profile again, no gauges until its steps show
        assert backend.router.live.cost("p2") is None and _gauges(backend.metrics, "p2") == {}
        beat("p2", 2, SLOW_PREFILL[0])  # 4 steps: not live yet
        assert _gauges(backend.metrics, "p2") == {}
        dead.append("d2")
        await backend.reap_lost_workers()  # d2's process is gone: its epoch retires, its gauges go
        assert backend.router.live.cost("d2") is None and _gauges(backend.metrics, "d2") == {}

    asyncio.run(scenario())


def test_bad_windows_are_ignored_and_counted_and_the_good_phase_still_folds():
    live = LiveCollectives(PRICING, min_steps=1)
    bad = [prefill(2, 20, math.nan, 0.0), prefill(2, 20, 0.1, math.inf), prefill(2, 20, -0.1, 0.0), prefill(-1, 20, 0.1, 0.0),
           prefill(0, 20, 0.0, 0.0), prefill(0, 0, 0.1, 0.0), prefill(4, 3, 0.1, 0.0)]
    for report in bad:
        assert live.fold("w", 2, report) is None
    assert live.num_ignored == {"not_finite": 2, "negative": 2, "inconsistent": 3}
    assert live.view("w")["ignored"] == dict(live.num_ignored) and live.view("w")["prefill"]["steps"] == 0
    mixed = CollectiveReport(prefill=window(2, 20, math.nan, 0.0), decode=SLOW_DECODE.decode)
    cost = live.fold("w", 2, mixed)
    assert cost == PRICING.worker(2, None, live.live_costs("w", "decode")) and live.num_ignored["not_finite"] == 3


def test_the_tally_reports_each_window_once_and_the_load_field_defaults_for_tp1_and_old_senders():
    tally = CollectiveTally()
    tally.add("prefill", 300, 0.05, 0.002)
    tally.add("decode", 4, 0.01, 0.001)
    tally.add("decode", 5, 0.02, 0.001)
    report = tally.take()
    assert report.prefill == window(1, 300, 0.05, 0.002)
    d = report.decode
    assert (d.steps, d.rows, d.rows_sq) == (2, 9, 41)
    assert (d.reduce_s, d.broadcast_s, d.rows_reduce_s) == pytest.approx((0.03, 0.002, 0.14), rel=1e-15)
    assert tally.take() == CollectiveReport()
    load = m.Load(0, 0, 0, 100, 0, collectives=report)
    assert m.decode_to_router(m.encode(m.Heartbeat("w", 1, load))).load.collectives == report
    old = msgspec.msgpack.encode({"pending_prompt_tokens": 0, "active_decode": 0, "num_running": 0, "free_blocks": 1,
                                  "reserved_blocks": 0})
    assert msgspec.msgpack.decode(old, type=m.Load).collectives is None  # a sender without the field
