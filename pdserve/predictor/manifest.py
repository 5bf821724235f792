"""The saved output-length predictor: its manifest (what a bucket means) and its weights.

Contract: a predictor file is one JSON object `{"pdserve_predictor": 1, ...}`. A bucket means
a resource bound only for the coordinates it was trained under, so the manifest records them:
the target model's checkpoint identity (`model.loader.checkpoint_hash`, the identity the router
and the engines already compare), the tokenizer's identity hash, the sampling settings of the
traced outputs, the context limit, and the bucket boundaries [a_0 = 0, ..., a_G]
(ledger/tetri.py's convention: bucket g is a_g <= y < a_{g+1}). `load(path, model_identity)`
refuses, with a message naming both, a predictor trained for another model or tokenizer.
`predict(ids)` maps prompt token ids to a `Prediction` (bucket and its bounds).
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pdserve.ledger.tetri import bucket_of, validate_buckets
from pdserve.predictor.features import FeatureSpec, featurize
from pdserve.predictor.softmax import SoftmaxModel

VERSION_KEY = "pdserve_predictor"
DEFAULT_BUCKETS = (0, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 1 << 20)


class PredictorError(ValueError):
    """A predictor file that cannot be used here (missing, malformed, or for another model)."""


@dataclass(frozen=True)
class Prediction:
    bucket: int
    lower_tokens: int  # a_g
    upper_tokens: int  # a_{g+1}: the conservative reservation coordinate


@dataclass(frozen=True)
class Manifest:
    model: str  # the name it was trained for (informational)
    model_identity: str  # checkpoint_hash of the target model
    tokenizer_identity: str
    sampling: dict  # the traced outputs' generation settings (temperature, top_p, ignore_eos, ...)
    max_model_len: int
    buckets: tuple[int, ...]
    features: FeatureSpec = field(default_factory=FeatureSpec)
    trained_on: dict = field(default_factory=dict)  # trace name, sizes, held-out accuracy vs baseline


@dataclass(frozen=True)
class LengthPredictor:
    manifest: Manifest
    model: SoftmaxModel

    def predict(self, ids: list[int] | tuple[int, ...]) -> Prediction:
        bucket = int(self.model.predict(featurize(ids, self.manifest.features)[None, :])[0])
        b = self.manifest.buckets
        return Prediction(bucket, b[bucket], b[bucket + 1])

    def label(self, output_tokens: int) -> int:
        """The bucket a recorded output length falls in (lengths past the last bound: the last)."""
        b = self.manifest.buckets
        return bucket_of(min(output_tokens, b[-1] - 1), b)

    def save(self, path: str | Path) -> None:
        man = asdict(self.manifest)
        man["features"] = asdict(self.manifest.features)
        doc = {VERSION_KEY: 1, **man, "weights_shape": list(self.model.weights.shape),
               "weights_f32_b64": _b64(self.model.weights), "bias_f32_b64": _b64(self.model.bias)}
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load(path: str | Path, model_identity: str | None = None, tokenizer_identity: str | None = None) -> LengthPredictor:
    """Read a predictor; with identities given, refuse one trained for another model/tokenizer."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PredictorError(f"--predictor {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise PredictorError(f"--predictor {path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get(VERSION_KEY) != 1:
        raise PredictorError(f"--predictor {path}: not a pdserve predictor (needs \"{VERSION_KEY}\": 1)")
    try:
        spec = doc["features"]
        man = Manifest(doc["model"], doc["model_identity"], doc["tokenizer_identity"], dict(doc["sampling"]),
                       int(doc["max_model_len"]), tuple(int(b) for b in doc["buckets"]),
                       FeatureSpec(int(spec["dim"]), tuple(spec["ngrams"]), tuple(spec["length_bins"])),
                       dict(doc.get("trained_on", {})))
        validate_buckets(man.buckets)
        shape = tuple(doc["weights_shape"])
        weights = _unb64(doc["weights_f32_b64"]).reshape(shape)
        bias = _unb64(doc["bias_f32_b64"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PredictorError(f"--predictor {path}: malformed ({exc})") from None
    if shape != (man.features.width, len(man.buckets) - 1) or bias.shape != (shape[1],):
        raise PredictorError(f"--predictor {path}: weights {shape} do not fit its features and buckets")
    if model_identity is not None and man.model_identity != model_identity:
        raise PredictorError(f"--predictor {path} was trained for model {man.model!r} (identity "
                             f"{man.model_identity[:16]}...), not the served model (identity {model_identity[:16]}...)")
    if tokenizer_identity is not None and man.tokenizer_identity != tokenizer_identity:
        raise PredictorError(f"--predictor {path} was trained with another tokenizer "
                             f"({man.tokenizer_identity[:16]}... vs served {tokenizer_identity[:16]}...)")
    return LengthPredictor(man, SoftmaxModel(weights, bias))


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def _unb64(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4").copy()
