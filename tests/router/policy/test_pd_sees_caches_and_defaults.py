"""Issue 36, parts 1-2: the P/D decision reads the caches the pair choice reads under every
policy, `--pd-min-prompt-tokens` counts uncached tokens, and the default server (no SLO flags)
protects running decodes with targets derived from its profile."""

from __future__ import annotations

import json

import pytest

from pdserve.api.server import router_for
from pdserve.cli import build_parser
from pdserve.commands.serve import serve_config
from pdserve.model.default import resolve_model
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.policy.pd_decision import PdPolicy, slo_line
from pdserve.router.pricing.cost import CostModel
from pdserve.router.router import Router

# round numbers: prefill 10 ms + 1 ms/token, decode step 20 ms + 1 ms/seq, 1 MB/s links, 100 B/token
COST = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.01, decode_step_base_s=0.02, decode_step_s_per_seq=1e-3,
                 same_host_bytes_per_s=1e6, cross_host_bytes_per_s=1e6, transfer_overhead_s=1e-3,
                 kv_bytes_per_token=100, block_size_tokens=16)
HISTORY = tuple(range(1000, 1064))  # a conversation's 64 blocks (1,024 tokens)
FOLLOW_UP = RouteRequest("turn2", prompt_tokens=1040, expected_output_tokens=1, block_hashes=HISTORY)


def pair_router(policy: str, pd: PdPolicy, decode_batch: int = 8) -> Router:
    """1P1D on one host; only D holds the history (it decoded the earlier turn)."""
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy=policy, cost=COST, pd=pd, ttft_slo_s=10.0,
                                 tpot_slo_s=0.1), clock=lambda: 0.0)
    for worker_id, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        router.register(WorkerInfo(worker_id, "h0", role, 1, 1000, "m", "abi"))
    router.report_load("p0", 1, WorkerLoad(0, 0, 1000))
    router.report_load("d0", 1, WorkerLoad(0, decode_batch, 1000, prefix_hashes=frozenset(HISTORY)))
    return router


@pytest.mark.parametrize("policy", ["jsq", "round_robin", "slo", "prefix"])
def test_a_follow_up_whose_history_only_d_holds_stays_local_under_every_policy(policy):
    router = pair_router(policy, PdPolicy("margin"))
    plan = router.route(FOLLOW_UP)
    assert isinstance(plan, RoutePlan) and plan.colocated and plan.pd.reason == "margin"
    # D computes the 16 tokens past its 64 cached blocks: one 26 ms chunk beside 8 decodes (a 54 ms
    # gap, within the profile-derived 5 x 21 ms target); handed off, P would recompute all 1,040
    assert plan.pd.tpot_slo_s == pytest.approx(5 * 0.021, abs=1e-12)
    assert plan.decode_hit_blocks == 64 and plan.compute_tokens == 16 and plan.transfer_bytes == 0
    assert plan.pd.terms.interference_saved_s == 0.0
    router.complete("turn2")
    router.assert_no_leaks()
    # the same prompt with nothing cached: 1,040 tokens in three chunks stall the 8 decodes
    cold = router.route(RouteRequest("cold", 1040, 1))
    assert not cold.colocated and cold.pd.disaggregate and cold.compute_tokens == 1040
    router.complete("cold")
    router.assert_no_leaks()


def test_the_prompt_floor_counts_uncached_tokens():
    router = pair_router("jsq", PdPolicy("always", min_prompt_tokens=64), decode_batch=0)
    follow_up = router.route(FOLLOW_UP)  # 1,040 tokens, 16 of them uncached at D: under the floor
    assert follow_up.colocated and follow_up.pd.reason == "min_prompt_tokens"
    cold = router.route(RouteRequest("cold", 1040, 16))  # 1,040 uncached: handed off
    assert not cold.colocated and cold.pd.reason == "always"
    for request_id in ("turn2", "cold"):
        router.complete(request_id)
    router.assert_no_leaks()


# `pdserve profile --model small` on one core (tests/router/policy/test_router_pd_agrees_with_planner.py)
PROFILE = {"kind": "profiled", "prefill_coef": [0.06, 2.5e-3, 4e-6], "decode_coef": [0.06, 1e-3, 3e-5],
           "kv_bytes_per_token": 12288, "kv_capacity_tokens": (512 << 20) // 12288,
           "meta": {"model": "small", "dtype": "bfloat16", "threads": 1, "block_size": 16}}


@pytest.fixture(scope="module")
def default_router_config(tmp_path_factory) -> RouterConfig:
    """The router `pdserve serve --model small --pd-profile FILE` builds: no other flag given."""
    path = tmp_path_factory.mktemp("profile") / "small.json"
    path.write_text(json.dumps(PROFILE))
    config = serve_config(build_parser().parse_args(["serve", "--model", "small", "--pd-profile", str(path)]))
    assert (config.policy, config.pd_decision) == ("jsq", "margin")
    return router_for(config, resolve_model("small")).config


def route_beside(config: RouterConfig, decode_batch: int, prompt_tokens: int = 2048, max_tokens: int = 128):
    router = Router(config, clock=lambda: 0.0)
    blocks = PROFILE["kv_capacity_tokens"] // 16
    for worker_id, role, batch in (("p0", Role.PREFILL, 0), ("d0", Role.DECODE, decode_batch)):
        router.register(WorkerInfo(worker_id, "h0", role, 1, blocks, config.model_identity, config.kv_abi_hash))
        router.report_load(worker_id, 1, WorkerLoad(0, batch, blocks))
    plan = router.route(RouteRequest("r", prompt_tokens, max_tokens))
    router.complete("r")
    router.assert_no_leaks()
    return plan


def test_the_default_server_hands_a_long_prompt_off_beside_32_decodes_and_keeps_it_beside_none(default_router_config):
    cfg = default_router_config
    busy = route_beside(cfg, 32)
    assert not busy.colocated and busy.pd.disaggregate and busy.pd.reason == "margin"
    assert cfg.pd.slo_source == "profile" and (cfg.pd.ttft_slo_s, cfg.pd.tpot_slo_s) == (None, None)
    assert (cfg.ttft_slo_s, cfg.tpot_slo_s, cfg.pd.safety_margin_s) == (30.0, 5.0, 0.0)  # admission's backstop
    # the startup line says so: 5 x (60 + 1 + 30.72) ms at 1,024 tokens
    assert "TPOT target 5x an idle decode step (profile; 458.6 ms at 1,024 tokens)" in slo_line(cfg.pd, cfg.cost)
    # the targets the margin read: 5 x the 2,048-token prompt's idle prefill (four 512-token chunks
    # at D) and 5 x an idle decode step at the request's context (2,048 + 64 tokens)
    cost = cfg.cost
    idle_prefill = sum(cost.at_decode_worker().chunked_prefill_s(2048, 0, 512))
    assert busy.pd.ttft_slo_s == pytest.approx(5 * idle_prefill, abs=1e-12)
    assert busy.pd.tpot_slo_s == pytest.approx(5 * float(cost.decode_step_at(1, 2048 + 64)), abs=1e-12)
    assert busy.pd.tpot_slo_s == pytest.approx(5 * (0.06 + 1e-3 + 3e-5 * 2112), abs=1e-12)  # 0.6218 s
    # each of the four chunks (1.9-5.0 s) is one inter-token gap far past 0.62 s for all 32 decodes
    assert busy.pd.terms.interference_saved_s > 32 * (idle_prefill - 4 * busy.pd.tpot_slo_s)
    idle = route_beside(cfg, 0)
    assert idle.colocated and not idle.pd.disaggregate and idle.pd.reason == "margin"
    assert idle.pd.terms.interference_saved_s == 0.0  # nothing to stall, the local TTFT within 5x
    # a client asking for 4,096 tokens no longer buys its prompt a local prefill beside 32 decodes
    assert route_beside(cfg, 32, max_tokens=4096).pd.disaggregate


def test_the_user_s_slo_flags_and_safety_margin_drive_the_decision(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(PROFILE))
    args = ["serve", "--model", "small", "--pd-profile", str(path), "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000"]
    loose = router_for(serve_config(build_parser().parse_args(args)), resolve_model("small")).config
    assert (loose.pd.ttft_slo_s, loose.pd.tpot_slo_s, loose.pd.slo_source) == (60.0, 10.0, "flags")
    assert (loose.ttft_slo_s, loose.tpot_slo_s) == (60.0, 10.0)  # admission reads them too
    kept = route_beside(loose, 32)  # a 10 s per-token target absorbs every chunk's gap
    assert kept.colocated and kept.pd.terms.interference_saved_s == 0.0
    config = serve_config(build_parser().parse_args(["serve", "--model", "small", "--pd-profile", str(path),
                                                     "--pd-safety-margin-ms", "1e9"]))
    assert config.pd_safety_margin_s == 1e6
    cautious = router_for(config, resolve_model("small")).config
    plan = route_beside(cautious, 32)
    assert plan.colocated and plan.pd.net_margin_s > 0  # a margin below the declared safety margin
    with pytest.raises(ValueError):
        PdPolicy("margin", safety_margin_s=-1.0)


def test_the_slo_flags_say_they_drive_the_decision():
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert "P/D margin decision" in helps["slo_ttft_ms"] and "P/D margin decision" in helps["slo_tpot_ms"]
    assert "uncached" in helps["pd_min_prompt_tokens"] and "margin" in helps["pd_safety_margin_ms"]


def test_a_prefix_p_fetches_counts_as_cached_at_p_in_the_decision():
    """The prefix policy with K/V sharing picks an idle P and fetches the history another prefill
    worker holds behind a long queue: the decision's compute set at P is what is left after the
    fetch (the choice's `PrefixTerms.hit_blocks`), not the whole prompt."""
    from pdserve.engine.kv.kv_events import BlockEventKind as K
    from pdserve.engine.kv.kv_events import KvTier as T
    from pdserve.router.kv.kv_index import KvDelta
    from pdserve.router.policy.pd_decision import decide_pd, facts_for

    cost = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.01, decode_step_base_s=0.02,
                     decode_step_s_per_seq=1e-3, same_host_bytes_per_s=2e9, cross_host_bytes_per_s=1e8,
                     transfer_overhead_s=0.0, kv_bytes_per_token=100, block_size_tokens=16, fetch_overhead_s=0.001,
                     fitted=True)
    pd = PdPolicy("margin", ttft_slo_s=10.0, tpot_slo_s=0.1)
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="prefix", cost=cost, pd=pd, ttft_slo_s=10.0,
                                 tpot_slo_s=0.1, kv_sharing=True), clock=lambda: 0.0)
    for wid, role, pending, batch in (("p0", Role.PREFILL, 5000, 0), ("p1", Role.PREFILL, 0, 0), ("d0", Role.DECODE, 0, 4)):
        router.register(WorkerInfo(wid, "h0", role, 1, 1000, "m", "abi"))
        router.report_load(wid, 1, WorkerLoad(pending, batch, 1000))
    router.report_kv("p0", 1, KvDelta(64, tuple((K.STORED, k, T.DEVICE) for k in HISTORY), True))
    request = RouteRequest("r", prompt_tokens=1040, expected_output_tokens=1, block_hashes=HISTORY)
    plan = router.route(request)
    assert (plan.prefill_id, plan.decode_id) == ("p1", "d0") and plan.prefix_terms.fetch_blocks == 64
    fetched = facts_for(request, 64, 0, True, 4, 0, 0.0, cost, arrival_rate_rps=0.0, decode_routed=1)
    assert fetched.remote_compute_tokens == 16
    assert plan.pd == decide_pd(fetched, pd, cost, 10.0, 0.1)
    router.complete("r")
    router.assert_no_leaks()


def test_the_router_reads_d_s_decode_clocks():
    """The frontend's per-heartbeat clocks (`note_decode_clocks`: each live decode's own budget and
    the batch's p90 gap) are what the decision's slack and gap terms read for that decode worker."""
    from pdserve.ledger.margin import DecodeBudget

    pd = PdPolicy("margin", ttft_slo_s=10.0, tpot_slo_s=1.0)
    router = pair_router("jsq", pd, decode_batch=1)
    # 400 tokens beside 1 decode: one 410 ms chunk, a 431 ms gap within the 1 s target; the newcomer-
    # style slack (the decode not reporting: 16 x (1 - 0.021) s) absorbs the 410 ms stall
    quiet = router.route(RouteRequest("quiet", 400, 16))
    assert quiet.colocated and quiet.pd.terms.interference_saved_s == 0.0
    router.complete("quiet")
    # its own budget: 99 tokens in 98.9 s, 1 left: 1 s x 99 gaps - 98.9 s - 21 ms = 79 ms of slack
    router.signals.note_decode_clocks("d0", (DecodeBudget(99, 98.9, 1),), 0.0)
    router.signals.arrivals.reset(0.0, 0.0)  # no arrival rate to share the slack with
    late = router.route(RouteRequest("late", 400, 16))
    assert late.pd.terms.interference_saved_s == pytest.approx(0.41 - (99 - 98.9 - 0.021), abs=1e-9)
    router.complete("late")
    # the batch's p90 gap of 700 ms: the 410 ms chunk opens a 1.11 s gap, 110 ms past the target
    router.signals.note_decode_clocks("d0", (), 0.7)
    router.signals.arrivals.reset(0.0, 0.0)
    gap = router.route(RouteRequest("gap", 400, 16))
    assert gap.pd.terms.interference_saved_s == pytest.approx(0.11, abs=1e-9)
    router.complete("gap")
    router.assert_no_leaks()


def test_a_short_prompt_s_default_ttft_target_is_the_workload_s_median_prompt():
    """Without SLO flags a short prompt was held to 5x its own idle prefill (0.37 s for 200 tokens
    here), so a prefill worker busy with long prompts made every short one look late there: the
    margin kept them local, and their chunks stalled D's decodes (the decision study's turns
    workload, RATE=0.6 on an AVX2 machine). A goodput benchmark holds every request to one target;
    the default now derives it at the workload's recent median prompt when that is the longer."""
    router = pair_router("jsq", PdPolicy("margin"))
    router.report_load("p0", 1, WorkerLoad(2000, 0, 1000))  # 2 s of prompts queued at P
    d_prefill = COST.at_decode_worker()
    first = router.route(RouteRequest("short0", prompt_tokens=200, expected_output_tokens=1))
    assert first.pd.ttft_slo_s == pytest.approx(5 * 0.21, abs=1e-12)  # no traffic yet: its own prompt
    # handed off its first token is 2.21 s away, 1.16 s late; local, the one 200-token chunk opens a
    # 238 ms gap for each of the 8 decodes, 133 ms past the 105 ms TPOT target: 1.064 s in all
    assert first.pd.terms.route_delta_s == pytest.approx(2.21 - 1.05, abs=1e-12)
    assert first.pd.terms.interference_saved_s == pytest.approx(8 * 0.133, abs=1e-12)
    assert first.colocated and not first.pd.disaggregate
    router.complete("short0")
    for i in range(4):  # the workload's long prompts
        router.route(RouteRequest(f"long{i}", prompt_tokens=1024, expected_output_tokens=1))
        router.complete(f"long{i}")
    assert router.signals.prompts.median() == 1024
    short = router.route(RouteRequest("short1", prompt_tokens=200, expected_output_tokens=1))
    target = 5 * sum(d_prefill.chunked_prefill_s(1024, 0, 512))
    assert short.pd.ttft_slo_s == pytest.approx(target, abs=1e-12) and target == pytest.approx(5.22, abs=1e-12)
    assert short.pd.terms.route_delta_s == 0.0  # 2.21 s is within the workload's 5.22 s
    assert not short.colocated and short.pd.disaggregate and short.pd.reason == "margin"
    # a prompt longer than the median keeps its own target
    long = router.route(RouteRequest("long9", prompt_tokens=4096, expected_output_tokens=1))
    assert long.pd.ttft_slo_s == pytest.approx(5 * sum(d_prefill.chunked_prefill_s(4096, 0, 512)), abs=1e-12)
    for request_id in ("short1", "long9"):
        router.complete(request_id)
    router.assert_no_leaks()
