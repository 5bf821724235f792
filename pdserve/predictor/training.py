"""Train and evaluate a length predictor from a JSON-lines trace with recorded output lengths.

Contract: `read_examples(trace, tokenizer)` -> (prompt ids, output lengths) in file order (the
bench's trace format; `prompt` text is tokenized as the API tokenizes a completion prompt).
`split(n, holdout, seed)` is a fixed permutation. `fit` trains on the training part and reports
held-out accuracy next to the majority baseline (always the training set's most common
bucket); both are exact for a given trace, buckets and seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.predictor.features import FeatureSpec, featurize_all
from pdserve.predictor.manifest import LengthPredictor, Manifest
from pdserve.predictor.softmax import train


@dataclass(frozen=True)
class Score:
    n: int
    accuracy: float  # predicted bucket == actual bucket
    baseline_accuracy: float  # always the most common training bucket
    coverage: float  # actual length < predicted upper bound (the reservation held)


def read_examples(trace: str | Path, tokenizer) -> tuple[list[list[int]], list[int]]:
    prompts, lengths = [], []
    for line_no, line in enumerate(Path(trace).read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        obj = json.loads(line)
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or "output_len" not in obj:
            raise ValueError(f"{trace}:{line_no}: a training line needs 'prompt' text and 'output_len'")
        prompts.append(tokenizer.encode(obj["prompt"]))
        lengths.append(int(obj["output_len"]))
    if not prompts:
        raise ValueError(f"{trace}: no examples")
    return prompts, lengths


def split(n: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    cut = n - max(1, int(round(n * holdout)))
    return order[:cut], order[cut:]


def fit(prompts: list[list[int]], lengths: list[int], manifest: Manifest, holdout: float = 0.2, seed: int = 0,
        l2: float = 1e-3, steps: int = 300) -> tuple[LengthPredictor, Score]:
    spec: FeatureSpec = manifest.features
    x = featurize_all(prompts, spec)
    probe = LengthPredictor(manifest, None)  # labels only need the buckets
    y = np.array([probe.label(n) for n in lengths])
    tr, te = split(len(prompts), holdout, seed)
    model = train(x[tr], y[tr], len(manifest.buckets) - 1, l2=l2, steps=steps)
    majority = int(np.bincount(y[tr], minlength=len(manifest.buckets) - 1).argmax())
    predictor = LengthPredictor(manifest, model)
    score = evaluate(predictor, [prompts[i] for i in te], [lengths[i] for i in te], majority)
    return predictor, score


def evaluate(predictor: LengthPredictor, prompts: list[list[int]], lengths: list[int], majority: int | None = None) -> Score:
    """Accuracy, the majority baseline (the given bucket, else this set's most common) and coverage."""
    x = featurize_all(prompts, predictor.manifest.features)
    y = np.array([predictor.label(n) for n in lengths])
    pred = predictor.model.predict(x)
    if majority is None:
        majority = int(np.bincount(y).argmax())
    uppers = np.asarray(predictor.manifest.buckets)[pred + 1]
    return Score(len(y), float(np.mean(pred == y)), float(np.mean(y == majority)),
                 float(np.mean(np.asarray(lengths) < uppers)))
