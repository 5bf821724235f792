"""The tiny model's length predictor trained once per test session on the committed trace.

`fit` is deterministic for a given trace, manifest, hold-out and seed (pdserve/predictor/training.py),
so every test that trains the default tiny predictor shares one fit instead of repeating it
(about 10 s of CPU each)."""

from __future__ import annotations

import functools
from pathlib import Path

from pdserve.model.default import resolve_model
from pdserve.model.loader import checkpoint_hash
from pdserve.model.tokenizer import load_tokenizer
from pdserve.predictor.manifest import DEFAULT_BUCKETS, Manifest
from pdserve.predictor.training import fit, read_examples

TRACE = Path(__file__).resolve().parents[2] / "docs" / "traces" / "tetri_lengths.jsonl"


@functools.cache
def tiny_fit():
    """(predictor, held-out score, prompts, tokenizer) of `fit(..., holdout=0.2, seed=0)` on TRACE."""
    model_dir = resolve_model("tiny")
    tok = load_tokenizer(model_dir)
    prompts, lengths = read_examples(TRACE, tok)
    manifest = Manifest("tiny", checkpoint_hash(model_dir), tok.identity_hash, {"temperature": 0.0}, 4096, DEFAULT_BUCKETS)
    predictor, score = fit(prompts, lengths, manifest, holdout=0.2, seed=0)
    return predictor, score, prompts, tok
