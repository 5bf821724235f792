"""Which leases the router renews: live, placed requests, by the id each worker knows."""

from __future__ import annotations

from pdserve.engine.sequence import SamplingParams
from pdserve.router.contract import GenerationRequest
from pdserve.router.process.frontend_upkeep import renewals
from pdserve.router.process.inflight import InFlight
from pdserve.router.process.output_collector import OutputCollector


def _live(rid: str, prefill: str = "", decode: str = "", done: bool = False, engine_id: str = "") -> InFlight:
    req = GenerationRequest(rid, (1, 2, 3), SamplingParams(max_tokens=2))
    return InFlight(req, 0, OutputCollector(), prefill_id=prefill, decode_id=decode, done=done, engine_id=engine_id)


def test_renewals_cover_each_worker_of_each_live_route():
    live = [_live("a", "p0", "d0"), _live("b", "p0", "d1", engine_id="b#g2"), _live("c", "c0", "c0"),
            _live("gone", "p0", "d0", done=True), _live("queued")]
    assert renewals(live) == {"c0": ("c",), "d0": ("a",), "d1": ("b#g2",), "p0": ("a", "b#g2")}
    assert renewals([]) == {}


def test_renewals_cover_each_running_fetch_on_its_destination_and_holder():
    live = [_live("a", "p0", "d0")]
    fetches = [("p0", "a/fetch1"), ("d0", "a/fetch1"), ("c1", "x/fetch2"), ("c0", "x/fetch2")]
    assert renewals(live, fetches) == {"c0": ("x/fetch2",), "c1": ("x/fetch2",), "d0": ("a", "a/fetch1"),
                                       "p0": ("a", "a/fetch1")}
