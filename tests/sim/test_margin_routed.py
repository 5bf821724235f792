"""The margin-routed disaggregated simulation (sim/margin_routed.py, issue 20).

A hand-checked run (constant step times), agreement with the oblivious simulator when every
request is handed off, conservation with rejections and preemptions, and the layering rule that
keeps the router's decision out of sim/ (it is passed in).
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

import pdserve
from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.lengths import parse_length_spec
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig
from pdserve.latency.base import ConstantLatency
from pdserve.latency.profiled import ProfiledLatency
from pdserve.sim.margin_routed import ArrivalView
from pdserve.sim.requests import SimRequests, build_requests
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.sim.transfer import LinkSpec

STEP = ConstantLatency(prefill_ms=100, decode_step_ms=10)
PROFILE = ProfiledLatency(prefill_coef=(0.06, 2.5e-3, 4e-6), decode_coef=(0.06, 1e-3, 3e-5), kv_bytes_per_token=12288)


def _requests(n: int, seed: int, prompts: str, outputs: str) -> SimRequests:
    return build_requests(WorkloadConfig(num_requests=n, input_len=parse_length_spec(prompts), seed=seed,
                                         output_len=parse_length_spec(outputs), arrival=ArrivalSpec("poisson"),
                                         prompt_style=PromptStyle(format="ids")))


def test_three_requests_by_hand():
    """r0 (100 tokens) handed off, r1 (50) kept on D, r2 (200) handed off; prefill 100 ms, step 10 ms.

    r0: P 0 -> 0.1 (first token), joins D at 0.1. r1 arrives at 0.05 to an idle D (r0 not there
    yet): its whole prompt is one 100 ms iteration, 0.05 -> 0.15, first token at 0.15; r0's K/V,
    ready at 0.1, joins at that boundary, so the local prefill delays it. Steps of 10 ms: r1's last
    token at 0.16, r0's two at 0.16 and 0.17. r2 arrives at 0.12: D is in r1's iteration, and reads
    as at its end (0.15): one decoding (r1), two live routes (r0 in transit, r1); P is idle again.
    P runs r2 0.12 -> 0.22; it joins the now idle D at 0.22, its one more token at 0.23.
    """
    requests = SimRequests((0.0, 0.05, 0.12), (100, 50, 200), (3, 2, 2), (0, 0, 0))
    seen: list[ArrivalView] = []
    decide = lambda view: seen.append(view) or view.prompt_tokens >= 100  # noqa: E731
    result = simulate(requests, 1.0, SimConfig(), STEP, STEP, decide=decide)
    first = [round(r.arrival_s + r.ttft_s, 12) for r in result.records]
    finish = [round(r.arrival_s + r.e2e_s, 12) for r in result.records]
    assert first == [0.1, 0.15, 0.22] and finish == [0.17, 0.16, 0.23]
    assert result.local_requests == (1,) and result.arrival_views == tuple(seen)
    # r1 reads P half way through r0's 100 rows; r2 reads D at the end of r1's prompt iteration
    assert [(v.decode_batch, v.decode_routed, v.decode_pending_tokens, v.prefill_pending_tokens) for v in seen] == [
        (0, 0, 0, 0), (0, 1, 0, 50), (1, 2, 0, 0)]
    assert (result.num_arrived, result.num_finished, result.num_rejected) == (3, 3, 0)


def test_a_queued_local_prompt_is_what_d_reports_pending():
    """Two prompts of 600 rows at D (chunks of 512): the second arrival sees the first's 88 rows left."""
    requests = SimRequests((0.0, 0.01), (600, 600), (2, 2), (0, 0))
    seen: list[ArrivalView] = []
    result = simulate(requests, 1.0, SimConfig(), STEP, STEP, decide=lambda v: seen.append(v) or False)
    assert seen[1].decode_pending_tokens == 600 - 512 and result.local_requests == (0, 1)
    # r0: 512 of its 600 rows, then its last 88 alone (r1's first chunk of 512 does not fit beside
    # them and may not be cut): 100 ms in all. r1 then runs its first chunk whole beside r0's one
    # decode (+10 ms, r0's last token), its last 88 rows alone: first token at 0.21
    assert [r.ttft_s for r in result.records] == pytest.approx([0.1, 0.2], abs=1e-12)


@pytest.mark.parametrize("prefill, decode", [(1, 1), (1, 3)])
@pytest.mark.parametrize("link", [LinkSpec(), LinkSpec(2e6, "layer", 12), LinkSpec(2e6, "request")])
def test_handing_every_request_off_is_the_oblivious_simulation(prefill, decode, link):
    """With one prefill instance, completion order is arrival order, so the joint simulation deals
    decode instances and transfers as the oblivious one does: TTFTs are identical, and finish times
    agree to rounding (its decode segments also end at each arrival)."""
    requests = _requests(300, 3, "uniform:16,1024", "uniform:2,64")
    config = SimConfig(prefill_replicas=prefill, decode_replicas=decode, link=link, max_decode_seqs=32)
    base = simulate(requests, 0.5, config, PROFILE)
    routed = simulate(requests, 0.5, config, PROFILE, decide=lambda _v: True)
    assert routed.local_requests == () and routed.num_finished == base.num_finished == 300
    assert [r.ttft_s for r in routed.records] == [r.ttft_s for r in base.records]
    assert [r.e2e_s for r in routed.records] == pytest.approx([r.e2e_s for r in base.records], rel=1e-9)
    assert routed.mean_transfer_exposed_s == pytest.approx(base.mean_transfer_exposed_s, rel=1e-12)


def test_every_arrival_is_finished_or_rejected():
    """A random router over a small K/V pool: rejections, preemptions, both routes; nothing lost."""
    pool = ProfiledLatency(prefill_coef=PROFILE.prefill_coef, decode_coef=PROFILE.decode_coef,
                           kv_bytes_per_token=12288, kv_capacity_tokens=1600)
    requests = _requests(400, 5, "uniform:16,1500", "uniform:1,200")
    coin = random.Random(7)
    result = simulate(requests, 2.0, SimConfig(decode_replicas=2, max_decode_seqs=8), pool,
                      decide=lambda _v: coin.random() < 0.5)
    assert result.num_arrived == result.num_finished + result.num_rejected == 400
    assert result.num_rejected > 0 and result.num_preempted > 0 and 0 < len(result.local_requests) < result.num_finished
    assert len(result.arrival_views) == result.num_finished
    for r in result.records:
        if r.success:
            assert 0 < r.ttft_s <= r.e2e_s
    for view in result.arrival_views:
        assert view.decode_routed >= view.decode_batch >= 0 and view.prefill_pending_tokens >= 0


def test_sim_does_not_import_the_router():
    """The decision is passed in (search/margin_routing.py): no sim module imports pdserve.router."""
    for path in (Path(pdserve.__file__).parent / "sim").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("pdserve.router") for n in names), path.name


def test_simulate_routes_by_margin_from_the_command_line(tmp_path, capsys):
    """`pdserve simulate --pd-decision margin`: the router's decision over a profile and --model's
    K/V geometry; without --model it refuses (the geometry prices the handoff)."""
    import json

    from pdserve.cli import build_parser

    profile = tmp_path / "small.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    argv = ["simulate", "--latency-model", str(profile), "--pd-decision", "margin", "--input-dist", "uniform:32,2048",
            "--output-len", "64", "--num-requests", "60", "--rate", "0.3", "--json"]
    args = build_parser().parse_args([*argv, "--model", "small"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pd_decision"] == "margin" and 0 < report["pd_local_requests"] < report["num_finished"] == 60
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit, match="needs a profiled --latency-model and --model"):
        args.func(args)
