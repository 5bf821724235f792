"""The router's cost model source (router/pricing/calibration.py): fitted on this machine at start when the
per-request margin decides, read from a `pdserve profile` file, or the placeholders on request."""

from __future__ import annotations

import json
import os
from dataclasses import replace
import subprocess
import sys

import pytest

from pdserve.api.server import ServeConfig, router_for
from pdserve.engine.config import EngineConfig
from pdserve.latency.tp_collectives import CollectiveCosts
from pdserve.model.cpu import ISA_CAPS
from pdserve.model.default import resolve_model
from pdserve.router.pricing import calibration
from pdserve.router.pricing.calibration import cost_profile, fit_key, profile_points
from pdserve.router.pricing.cost import CostModel
from pdserve.workers.process.tp_rank import TpShape

TINY = EngineConfig(model="tiny", kv_cache_bytes=32 << 20, max_num_batched_tokens=128)


@pytest.fixture(autouse=True)
def private_fits(tmp_path, monkeypatch):
    """Each test keeps its fits in its own folder: "auto" here must measure, not read a fit an
    earlier run left in ~/.cache/pdserve/fits."""
    monkeypatch.setattr(calibration, "fit_cache_root", lambda: tmp_path / "fits")
    return tmp_path / "fits"


def test_profile_points_stay_inside_the_chunk_and_the_context():
    assert profile_points(512, 4096) == {"prompt_lens": (64, 256, 512), "batches": (1, 8), "contexts": (64, 256), "repeats": 2}
    points = profile_points(2048, 200)
    assert max(points["prompt_lens"]) == 184 and max(points["contexts"]) <= 184


def test_auto_fits_the_served_engine_and_the_router_decides_with_it(tmp_path):
    """The fit runs the served engine's shape: its block size too (before, always 16: a server with
    `--block-size 32` was priced by an engine it never runs)."""
    model_dir = resolve_model("tiny")
    fitted = cost_profile("auto", replace(TINY, block_size=32), 1, model_dir, 512)
    assert fitted["meta"]["block_size"] == 32 and fitted["meta"]["chunk_tokens"] == 128
    assert fitted["kind"] == "profiled" and len(fitted["prefill_coef"]) == 3 and len(fitted["decode_coef"]) == 3
    assert "collectives" not in fitted  # TP 1 everywhere: nothing to time
    assert all(c >= 0 for c in fitted["prefill_coef"] + fitted["decode_coef"])
    assert sum(fitted["prefill_coef"]) > 0 and sum(fitted["decode_coef"]) > 0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(fitted))
    router = router_for(ServeConfig(engine=TINY, pd_decision="margin", pd_profile=str(path)), model_dir)
    placeholders = router_for(ServeConfig(engine=TINY, pd_decision="margin", pd_profile="none"), model_dir)
    assert router.config.cost.prefill_s_per_token != placeholders.config.cost.prefill_s_per_token
    assert router.config.cost.decode_step_base_s == fitted["decode_coef"][0]


def test_auto_fits_in_a_child_process_so_the_router_never_loads_the_engine():
    code = ("import sys; from pdserve.router.pricing.calibration import cost_profile; "
            "from pdserve.engine.config import EngineConfig; from pdserve.model.default import resolve_model; "
            "f = cost_profile('auto', EngineConfig(model='tiny', kv_cache_bytes=32 << 20, max_num_batched_tokens=128), 1, "
            "resolve_model('tiny'), 512); "
            "print(f['kind'], sorted(m for m in sys.modules if m.startswith(('pdserve.engine.engine', 'pdserve.latency.engine_profile'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=True)
    assert out.stdout.split() == ["profiled", "[]"]  # fitted, and neither the engine nor the profiler imported here


def test_auto_times_the_collectives_of_a_tp_deployment_and_the_router_prices_with_them(tmp_path):
    model_dir = resolve_model("tiny")
    fitted = cost_profile("auto", TINY, 1, model_dir, 512, tp=1, collective_sizes=(1, 2))
    assert fitted["meta"]["tp"] == 1  # the steps at the prefill role's size (TP 1 here)
    (two,) = fitted["collectives"]  # timed at the one size > 1 (latency/tp_collectives.py)
    costs = CollectiveCosts.from_dict(two)
    assert costs.tp == 2 and costs.pinned and costs.median_allreduce_s > 0 and costs.step_sync_s > 0
    assert costs.median_allreduce_s >= costs.allreduce_s and costs.median_step_sync_s >= costs.step_sync_s
    path = tmp_path / "p.json"
    path.write_text(json.dumps(fitted))
    config = ServeConfig(engine=TINY, pd_decision="margin", pd_profile=str(path), tp=TpShape(prefill=1, decode=2))
    router = router_for(config, model_dir)
    assert router.config.pricing.scaling.collectives == (costs,)  # not the defaults
    # the decode role's TP 2 step: the profile's decode terms x c(2)/c(1) + 16 (engine-shaped) all_reduces + the broadcast
    scaling, base = router.config.pricing.scaling, router.config.pricing.base
    f = scaling.units("decode", 2) / scaling.units("decode", 1)
    fixed = base.decode_step_base_s * f + 16 * costs.engine_shaped().allreduce_s + costs.step_sync_s
    assert router.config.cost.decode_step_base_s == pytest.approx(max(0.0, fixed), rel=1e-12)


def test_only_the_margin_pays_for_a_fit_at_start():
    model_dir = resolve_model("tiny")
    always = router_for(ServeConfig(engine=TINY, pd_decision="always"), model_dir)  # "auto" without margin: none
    none = router_for(ServeConfig(engine=TINY, pd_decision="margin", pd_profile="none"), model_dir)
    assert always.config.cost == none.config.cost


def test_the_serve_flag_bounds_the_router_s_kv_index():
    router = router_for(ServeConfig(engine=TINY, pd_decision="always", kv_index_max_entries=1000), resolve_model("tiny"))
    assert router.kv_index_stats().max_entries == 1000


def test_colocated_serving_fits_its_cost_model_at_its_first_start_only(monkeypatch):
    """Colocated fetch decisions weigh measured link rates against the prefill they save, which
    kv_rates.py only does on a fitted model: "auto" fits there too (pinned P/D decisions skip it).
    What `pdserve serve` calls at start: the first router measures (a real fit in its child), a
    second start of the same deployment reads the kept fit and spawns no child."""
    model_dir = resolve_model("tiny")
    config = ServeConfig(engine=TINY, mode="colocated", replicas=2)
    colocated = router_for(config, model_dir)
    assert colocated.config.cost.fitted
    assert colocated.config.cost.prefill_s_per_token != CostModel().prefill_s_per_token

    def no_child(*args, **kwargs):
        raise AssertionError("a second start measured again")

    monkeypatch.setattr(calibration, "fit_in_child", no_child)
    assert router_for(config, model_dir).config.cost == colocated.config.cost


def test_one_colocated_replica_without_a_host_tier_starts_without_a_fit():
    """One colocated replica with no host tier under jsq has nothing to price (no other holder to
    fetch from, no promotion, a queue-length choice): "auto" skips the fit that would delay its
    start-up; a host tier, a second replica or a pricing policy bring it back."""
    from pdserve.api.server import _prices_on_this_machine

    one = ServeConfig(engine=TINY, mode="colocated", replicas=1)
    assert not _prices_on_this_machine(one)
    placeholders = ServeConfig(engine=TINY, mode="colocated", replicas=1, pd_profile="none")
    assert router_for(one, resolve_model("tiny")).config.cost == router_for(placeholders, resolve_model("tiny")).config.cost
    host = EngineConfig(**{**TINY.__dict__, "host_kv_bytes": 16 << 20})
    for config in (ServeConfig(engine=TINY, mode="colocated", replicas=2), ServeConfig(engine=host, mode="colocated", replicas=1),
                   ServeConfig(engine=TINY, mode="colocated", replicas=1, policy="slo")):
        assert _prices_on_this_machine(config), config


def test_a_kept_fit_serves_later_starts_until_anything_it_depends_on_changes(private_fits, monkeypatch):
    """"auto" measures once and keeps the fit; a later start with the same key reads it; "refit"
    measures again and replaces it; another thread count, ISA cap or engine setting is another
    key; an unreadable file is measured again, never an error."""
    for name in (*ISA_CAPS, "PDSERVE_MARCH"):  # from no cap (a run under the caps would start from them)
        monkeypatch.delenv(name, raising=False)
    fits = []

    def fake_fit(engine, threads, model_dir, max_model_len, tp=1, sizes=()):
        fits.append(threads)
        return {"kind": "profiled", "prefill_coef": [0.001 * len(fits), 1e-5, 0.0], "decode_coef": [0.002, 0.0, 1e-7]}

    monkeypatch.setattr(calibration, "fit_in_child", fake_fit)
    model_dir = resolve_model("tiny")
    first = cost_profile("auto", TINY, 1, model_dir, 512)
    assert cost_profile("auto", TINY, 1, model_dir, 512) == first and len(fits) == 1  # read, not measured
    assert [p.name for p in private_fits.iterdir()] == [f"{fit_key(TINY, 1, model_dir, 512)}.json"]
    again = cost_profile("refit", TINY, 1, model_dir, 512)
    assert len(fits) == 2 and again != first and cost_profile("auto", TINY, 1, model_dir, 512) == again
    cost_profile("auto", TINY, 2, model_dir, 512)  # another thread count
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cost_profile("auto", TINY, 1, model_dir, 512)  # the AVX2 code paths
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    f32 = EngineConfig(**{**TINY.__dict__, "dtype": "float32"})
    cost_profile("auto", f32, 1, model_dir, 512)
    assert len(fits) == 5
    (private_fits / f"{fit_key(TINY, 1, model_dir, 512)}.json").write_text("{not json")
    assert cost_profile("auto", TINY, 1, model_dir, 512)["prefill_coef"][0] == pytest.approx(0.006)
    assert len(fits) == 6
    assert cost_profile("auto", TINY, 1, model_dir, 512) == cost_profile("auto", TINY, 1, model_dir, 512)
    assert len(fits) == 6


def test_a_kept_fit_that_is_not_three_numbers_a_phase_is_measured_again_not_read(tmp_path):
    """The kept-fit cache reads what CostModel.from_profile can use and nothing else: a file whose
    coefficients are lists of another length (a damaged or foreign file) counts as no fit (before:
    it was returned and the router's start failed unpacking it)."""
    path = tmp_path / "fit.json"
    good = {"prefill_coef": [0.001, 0.0002, 1e-8], "decode_coef": [0.002, 0.0001, 1e-7]}
    path.write_text(json.dumps(good))
    assert calibration._read_fit(path) == good
    for bad in ({**good, "prefill_coef": [0.001]}, {**good, "decode_coef": [0.1, 0.2, "x"]}, {"prefill_coef": [1, 2, 3]}):
        path.write_text(json.dumps(bad))
        assert calibration._read_fit(path) is None, bad
