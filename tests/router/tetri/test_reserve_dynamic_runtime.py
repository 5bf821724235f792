"""`--reserve dynamic` end to end on real worker processes (tiny model): requests reserve their
predicted bucket, outgrow it, grow their holds and are preempted by recompute on a decode pool
too small for all of them, and every one finishes with the tokens of an unpreempted run; no
block or hold leaks. Bad predictor inputs are refused before any worker starts."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace

import pytest

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.cli import main as cli_main
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.sequence import SamplingParams
from pdserve.model.default import resolve_model
from pdserve.predictor.manifest import PredictorError
from pdserve.router.tetri.reserve_mode import load_policy
from tests.helpers.predictors import TRACE, tiny_fit
from tests.runtime.conftest import TINY, WORKER_THREADS, collect, config, wait_baseline


@pytest.fixture(scope="module")
def tiny_predictor(tmp_path_factory):
    predictor, _, _, tok = tiny_fit()  # fit(..., holdout=0.2, seed=0), shared with tests/predictor
    path = tmp_path_factory.mktemp("predictor") / "tiny.json"
    predictor.save(path)
    return path, predictor, tok


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_outgrown_holds_grow_then_preempt_by_recompute_with_exact_tokens_and_no_leaks(tiny_predictor):
    path, predictor, tok = tiny_predictor
    lines = [json.loads(s) for s in TRACE.read_text().splitlines()]
    prompts = [tuple(tok.encode(e["prompt"])) for e in lines if e["task"] == "tag"]
    prompts = [p for p in prompts if len(p) <= 32 and predictor.predict(p).upper_tokens == 64][:5]
    assert len(prompts) == 5
    # 4 MiB of fp32 = 32 blocks per worker: each reserves ceil((<=32 + 64) / 16) = 6, the five fit (30); at
    # 120 tokens each needs 10, 50 in all: holds must grow, and then requests must be preempted
    # fp32 batch-invariant mode: a recomputed position's K/V (prefill rows) equals its decoded one
    engine = replace(TINY, dtype="float32", kv_cache_bytes=4 << 20)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    reference = Engine(EngineConfig(model="tiny", dtype="float32", num_blocks=256, num_threads=WORKER_THREADS))
    # one batch: the engine is batch-invariant (the served run batches them too), 5x less CPU than one by one
    expected = [list(out.output_ids) for out in reference.generate([list(p) for p in prompts], params)]

    async def main():
        async with cluster(config(engine=engine, reserve="dynamic", predictor=str(path))) as (backend, _):
            results = await asyncio.gather(*(collect(backend, f"t{i}", p, params) for i, p in enumerate(prompts)))
            for (ids, event), want in zip(results, expected):
                assert isinstance(event, FinishEvent) and event.finish_reason == "length"
                assert ids == want  # preempted and recomputed requests too
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            text = backend.metrics_text().decode()
            assert _metric(text, "pdserve_reservation_growths_total") >= 1
            assert _metric(text, "pdserve_reservation_growth_blocks_total") >= 5 * 3  # 6 held, 10 used
            assert _metric(text, "pdserve_reservation_preemptions_total") >= 1
            assert _metric(text, 'pdserve_reserve_mode{mode="dynamic"}') == 1.0
            assert _metric(text, 'pdserve_prediction_outcomes_total{outcome="under"}') == 5.0
            assert _metric(text, "pdserve_prediction_coverage") == 0.0
            assert 'pdserve_requests_total{result="completed"} 5.0' in text
            assert "pdserve_early_rejections_total{" not in text
            assert {w.load.get("reserve_mode") for w in backend.workers()} == {"dynamic"}
            with pytest.raises(InvalidRequest, match="could never fit"):  # its hold could never grow to max_tokens here
                await collect(backend, "huge", prompts[0], SamplingParams(max_tokens=1000, ignore_eos=True))

    asyncio.run(main())


def test_bad_predictor_inputs_are_refused_at_start(tiny_predictor, tmp_path, capsys):
    path, _, _ = tiny_predictor
    with pytest.raises(ValueError, match="needs --predictor"):
        config(reserve="dynamic")
    with pytest.raises(PredictorError, match="cannot read"):
        load_policy("dynamic", str(tmp_path / "missing.json"), resolve_model("tiny"))
    with pytest.raises(PredictorError, match="trained for model 'tiny'"):
        load_policy("dynamic", str(path), resolve_model("small"))
    assert cli_main(["serve", "--reserve", "dynamic"]) == 2
    assert "needs --predictor" in capsys.readouterr().err
    assert cli_main(["serve", "--model", "small", "--reserve", "dynamic", "--predictor", str(path)]) == 2
    assert "trained for model 'tiny'" in capsys.readouterr().err
    assert load_policy("dynamic", str(path), resolve_model("tiny")).mode == "dynamic"


def test_p2c_places_decodes_on_both_workers_and_the_trace_records_the_reservation(tiny_predictor, tmp_path):
    """1P2D with --decode-choice p2c and --reserve dynamic: --policy still picks the prefill
    worker, p2c spreads the decodes over both decode workers; each trace line names its reserve
    mode, hold and predicted bucket; nothing leaks."""
    path, predictor, tok = tiny_predictor
    lines = [json.loads(s) for s in TRACE.read_text().splitlines()][:8]
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        cfg = config(num_decode=2, decode_choice="p2c", reserve="dynamic", predictor=str(path), trace_dir=str(tmp_path))
        async with cluster(cfg) as (backend, _):
            results = await asyncio.gather(*(collect(backend, f"p{i}", tuple(tok.encode(e["prompt"])),
                                                     replace(params, scripted_eos_tokens=e["output_len"] // 4))
                                             for i, e in enumerate(lines)))
            assert all(isinstance(ev, FinishEvent) and ev.finish_reason == "stop" for _, ev in results)
            await wait_baseline(backend)
            backend.router.assert_no_leaks()
            rows = {w.id: w.load for w in backend.workers()}
            assert rows["decode-0"]["heavy_decodes"] == rows["decode-0"]["light_decodes"] == 0
        trace = [json.loads(s) for s in (tmp_path / "requests.jsonl").read_text().splitlines()]
        assert {t["decode"] for t in trace} == {"decode-0", "decode-1"}
        for t, e in zip(sorted(trace, key=lambda t: int(t["request_id"][1:])), lines):
            want = predictor.predict(tok.encode(e["prompt"]))
            assert (t["reserve_mode"], t["reserve_tokens"], t["predicted_bucket"]) == ("dynamic", want.upper_tokens,
                                                                                      want.bucket)

    asyncio.run(main())
