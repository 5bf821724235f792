"""The output-length predictor: learns the committed synthetic trace, beats the majority bucket
on a held-out split, round-trips through its file, and refuses another model's identity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.cli import main as cli_main
from pdserve.model.default import resolve_model
from pdserve.model.loader import checkpoint_hash
from pdserve.model.tokenizer import load_tokenizer
from pdserve.predictor.features import FeatureSpec, featurize
from pdserve.predictor.manifest import DEFAULT_BUCKETS, PredictorError, load
from pdserve.predictor.synth import TASKS, synth_entries
from tests.helpers.predictors import TRACE, tiny_fit


@pytest.fixture(scope="module")
def tiny():
    model_dir = resolve_model("tiny")
    return checkpoint_hash(model_dir), load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def trained():
    """fit(..., holdout=0.2, seed=0) on TRACE, shared with the other tests that train it."""
    predictor, score, prompts, _ = tiny_fit()
    return (predictor, score), prompts


def test_committed_trace_is_the_generator_output_and_lengths_follow_the_task():
    lines = [json.loads(s) for s in TRACE.read_text().splitlines()]
    assert lines == synth_entries(1500, seed=0, noise=0.1)
    ranges = {name: (lo, hi) for name, lo, hi in TASKS}
    on_rule = sum(ranges[e["task"]][0] <= e["output_len"] <= ranges[e["task"]][1] for e in lines)
    assert 0.85 < on_rule / len(lines) < 0.95  # the rest run one range longer (noise 0.1 of two tasks in three)
    assert all(32 <= e["output_len"] <= 128 for e in lines)


def test_beats_the_majority_bucket_on_held_out_split(trained):
    (_, score), _ = trained
    assert score.n == 300
    assert score.accuracy == pytest.approx(0.9333333, abs=1e-6)  # fixed seed: exact
    assert score.baseline_accuracy == pytest.approx(0.4233333, abs=1e-6)
    assert score.accuracy > score.baseline_accuracy + 0.4


def test_file_round_trip_predicts_the_same_and_refuses_another_model(trained, tiny, tmp_path):
    (predictor, _), prompts = trained
    path = tmp_path / "p.json"
    predictor.save(path)
    identity, tok = tiny
    again = load(path, identity, tok.identity_hash)
    assert [again.predict(p) for p in prompts[:50]] == [predictor.predict(p) for p in prompts[:50]]
    pred = again.predict(prompts[0])
    assert pred.upper_tokens == DEFAULT_BUCKETS[pred.bucket + 1] and pred.lower_tokens == DEFAULT_BUCKETS[pred.bucket]
    with pytest.raises(PredictorError, match="trained for model 'tiny'"):
        load(path, checkpoint_hash(resolve_model("small")))
    with pytest.raises(PredictorError, match="another tokenizer"):
        load(path, identity, "0" * 64)
    with pytest.raises(PredictorError, match="cannot read"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PredictorError, match="not a pdserve predictor"):
        load(tmp_path / "bad.json")


def test_features_are_deterministic_and_length_aware():
    spec = FeatureSpec(dim=64)
    a = featurize([1, 2, 3, 4], spec)
    assert np.array_equal(a, featurize([1, 2, 3, 4], spec)) and a.shape == (spec.width,)
    assert np.linalg.norm(a[:64]) == pytest.approx(1.0, rel=1e-5)
    assert a[64] == 1.0  # length 4 falls in the first bin (<= 16)
    assert not np.array_equal(a, featurize([4, 3, 2, 1], spec))


def test_cli_train_and_eval(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli_main(["predictor", "train", str(TRACE), "--out", str(out), "--model", "tiny"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["heldout_accuracy"] > trained["baseline_accuracy"]
    doc = json.loads(out.read_text())
    assert doc["buckets"] == list(DEFAULT_BUCKETS) and doc["sampling"]["temperature"] == 0.0
    assert doc["model_identity"] == checkpoint_hash(resolve_model("tiny"))
    assert cli_main(["predictor", "eval", str(out), str(TRACE), "--model", "tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] > 0.9
    assert cli_main(["predictor", "eval", str(out), str(TRACE), "--model", "small"]) == 2
    assert "trained for model 'tiny'" in capsys.readouterr().err
