"""The aic latency model: aiconfigurator's step estimates behind pdserve's latency contract (issue 24, part 1).

Tests that need aiconfigurator itself skip only when the package is absent (`pip install
'pdserve[aic]'`; scripts/setup.sh installs it); the spec parsing and the missing-extra error do not.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from pdserve.latency.aic import MISSING, AicSpec, _bracket, require_aic

needs_aic = pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                               reason="aiconfigurator is not installed (pip install 'pdserve[aic]')")


def test_spec_parsing():
    assert AicSpec.parse("aic:h200_sxm") == AicSpec("h200_sxm", "trtllm", None)
    assert AicSpec.parse("aic:h100_sxm:vllm") == AicSpec("h100_sxm", "vllm", None)
    assert AicSpec.parse("aic:h100_sxm:trtllm:1.3.0rc20") == AicSpec("h100_sxm", "trtllm", "1.3.0rc20")
    assert str(AicSpec.parse("aic:h200_sxm")) == "aic:h200_sxm:trtllm"
    for bad in ("aic:", "aic", "aic:h200_sxm::", "aic:a:b:c:d", "roof:h200_sxm"):
        with pytest.raises(ValueError, match="expected aic:SYSTEM"):
            AicSpec.parse(bad)


def test_grid_brackets():
    assert _bracket(5.5) == (5, 6) and _bracket(16) == (16, 16)
    assert _bracket(4096) == (4096, 4096)  # 2 ** 12 is a grid point
    lo, hi = _bracket(4250)
    assert lo == 4096 and hi == round(2 ** (97 / 8)) and lo < 4250 < hi


def test_missing_extra_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiconfigurator_core" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'pdserve\[aic\]'"):
        require_aic()
    from pdserve.latency.geometry import load_model_spec
    from pdserve.latency.spec import resolve_latency

    with pytest.raises(ValueError) as err:
        resolve_latency("aic:h200_sxm", load_model_spec("llama-13b-class"))
    assert str(err.value) == MISSING


@pytest.fixture(scope="module")
def qwen3_32b():
    if importlib.util.find_spec("aiconfigurator_core") is None:
        pytest.skip("aiconfigurator is not installed")
    from pdserve.latency.aic import aic_family
    from pdserve.latency.geometry import load_model_spec

    return aic_family(AicSpec.parse("aic:h200_sxm"), load_model_spec("Qwen/Qwen3-32B"))


@needs_aic
def test_step_times_are_aiconfigurators_at_grid_points(qwen3_32b):
    from aiconfigurator_core.sdk import config
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database
    from aiconfigurator_core.sdk.rust_engine_step import _cached_engine_handle

    m = qwen3_32b(4, 1)
    handle = _cached_engine_handle(get_model("Qwen/Qwen3-32B", config.ModelConfig(tp_size=4), "trtllm"),
                                   get_database("h200_sxm", "trtllm", m.version))
    assert m.decode_step_s(64, 64 * 4096) == handle.decode_step_latency(64, 4095, 1) * 1e-3
    assert m.prefill_s(4096) == handle.predict_prefill_latency(1, 4096, 0) * 1e-3
    assert m.prefill_batch_s((2048, 2048), (0, 0)) == handle.predict_prefill_latency(2, 2048, 0) * 1e-3
    assert m.mixed_step_s(1024, 0, 0, 0.25, 32, 32 * 4096) == handle.mixed_step_latency(1024, 32, 4096, 1, 0) * 1e-3
    between = m.decode_step_s(64, 64 * 4250)  # interpolated between the grid points around 4250
    assert m.decode_step_s(64, 64 * 4096) < between < m.decode_step_s(64, 64 * round(2 ** (97 / 8)))


@needs_aic
def test_contract_invariants(qwen3_32b):
    tp1, tp4 = qwen3_32b(1, 1), qwen3_32b(4, 1)
    assert qwen3_32b(4, 1) is tp4  # one model per shape: its cache is shared
    assert tp4.decode_step_s(0, 0) == 0.0
    for batch, context in ((12, 12 * 800), (64, 64 * 4095), (3, 3 * 16)):
        d0, d1 = tp4.decode_segment_s(batch, context)
        assert d0 == pytest.approx(tp4.decode_step_s(batch, context), rel=1e-12)
        assert d0 + d1 == pytest.approx(tp4.decode_step_s(batch, context + batch), rel=1e-12)
    steps = [tp4.decode_step_s(b, b * 2000) for b in (1, 8, 64, 128)]
    assert steps == sorted(steps) and steps[0] > 0
    assert tp4.prefill_s(4000) < tp1.prefill_s(4000) and tp4.decode_step_s(8, 16000) < tp1.decode_step_s(8, 16000)
    assert tp4.prefill_s(2000, 2000) < tp4.prefill_s(4000)  # a cached prefix is cheaper than recomputing it
    assert tp4.mixed_step_s(0, 0, 0, 0.0, 8, 16000) == tp4.decode_step_s(8, 16000)
    assert tp4.pipeline_stages == 1 and qwen3_32b(2, 2).pipeline_stages == 2
    assert tp4.kv_bytes_per_token == 64 * 2 * 8 * 128 * 2
    # (4 x 0.9 x 141 GiB-class memory - 65.5 GB of weights) / 262,144 B per token
    assert tp4.kv_capacity_tokens == int((4 * 0.9 * 151397597184 - 65_524_246_528) // 262_144)
    assert tp4.to_dict() == {"kind": "aic", "spec": "aic:h200_sxm:trtllm", "version": tp4.version,
                             "model": "Qwen/Qwen3-32B", "tp": 4, "pp": 1}


@needs_aic
def test_unknown_system_backend_version_and_model_are_named(tmp_path):
    from pdserve.latency.aic import aic_family
    from pdserve.latency.geometry import load_model_spec

    qwen = load_model_spec("Qwen/Qwen3-32B")
    with pytest.raises(ValueError, match="no database for system 'h900_sxm' \\(it has: .*h200_sxm"):
        aic_family(AicSpec.parse("aic:h900_sxm"), qwen)
    with pytest.raises(ValueError, match="no 'tensorrt' data for h200_sxm \\(backends: .*trtllm"):
        aic_family(AicSpec.parse("aic:h200_sxm:tensorrt"), qwen)
    with pytest.raises(ValueError, match="has no version '0.0.1' \\(versions: "):
        aic_family(AicSpec.parse("aic:h200_sxm:trtllm:0.0.1"), qwen)
    with pytest.raises(ValueError, match="not the built-in 'tiny'"):
        aic_family(AicSpec.parse("aic:h200_sxm"), load_model_spec("tiny"))
    config = json.loads(open(qwen.source if qwen.source.endswith(".json") else _bundled("Qwen/Qwen3-32B")).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["SomeFutureDenseForCausalLM"]}))
    with pytest.raises(ValueError, match="aiconfigurator cannot model"):
        aic_family(AicSpec.parse("aic:h200_sxm"), load_model_spec(str(tmp_path / "config.json")))


def _bundled(hf_id: str) -> str:
    from pdserve.latency.geometry import bundled_config

    return str(bundled_config(hf_id))


@needs_aic
def test_a_local_config_is_timed_like_the_shipped_one(tmp_path, qwen3_32b):
    from pdserve.latency.aic import aic_family
    from pdserve.latency.geometry import load_model_spec

    (tmp_path / "qwen3-32b.json").write_text(open(_bundled("Qwen/Qwen3-32B")).read())  # not named config.json
    local = aic_family(AicSpec.parse("aic:h200_sxm"), load_model_spec(str(tmp_path / "qwen3-32b.json")))(4, 1)
    assert local.decode_step_s(32, 32 * 3000) == qwen3_32b(4, 1).decode_step_s(32, 32 * 3000)


@needs_aic
def test_simulate_and_plan_accept_aic(capsys):
    from pdserve.cli import main

    common = ["--input-len", "2000", "--output-len", "200", "--num-requests", "100", "--slo-ttft-ms", "1000",
              "--slo-tpot-ms", "30", "--json"]
    assert main(["simulate", "--latency-model", "aic:h200_sxm", "--model", "Qwen/Qwen3-8B", "--tp", "1",
                 "--mode", "colocated", "--rate", "2", *common]) == 0
    sim = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sim["num_finished"] == 100 and 0 < sim["mean_ttft_ms"] < 1000
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--latency-model", "aic:h200_sxm", "--gpus", "2",
                 "--chunk-budgets", "1024", "--max-seqs", "64", "--quiet", *common]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["latency_model"] == "aic:h200_sxm" and plan["hardware"] == "h200"
    assert plan["decided_by"] == "goodput_per_gpu" and plan["colocated"]["goodput_rps"] > 0
    with pytest.raises(SystemExit, match="needs --model"):
        main(["simulate", "--latency-model", "aic:h200_sxm", "--rate", "1", *common])
    with pytest.raises(SystemExit, match="no built-in hardware profile for aic system 'b200_sxm'"):
        main(["plan", "--model", "Qwen/Qwen3-8B", "--latency-model", "aic:b200_sxm", "--gpus", "2", "--quiet", *common])
