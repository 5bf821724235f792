"""Prompt token ids -> a fixed-width feature vector for the length classifier.

Contract: `featurize(ids, spec)` is pure and deterministic: hashed token n-gram counts (each
n-gram's ids hashed with a fixed multiplier into `spec.dim` slots, counts scaled by log1p and
the row L2-normalised) followed by the prompt length as one-hot bins over `spec.length_bins`
and log(1 + length) / 10. Same ids and spec, same vector, on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MULT = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


@dataclass(frozen=True)
class FeatureSpec:
    dim: int = 2048  # hashed n-gram slots
    ngrams: tuple[int, ...] = (1, 2, 3)
    length_bins: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)  # upper edges

    @property
    def width(self) -> int:
        return self.dim + len(self.length_bins) + 2  # + the bin past the last edge + log length


def _ngram_slots(ids: np.ndarray, n: int, dim: int) -> np.ndarray:
    """Slot of every n-gram of `ids` ([L] uint64 -> [L - n + 1])."""
    h = np.full(len(ids) - n + 1, np.uint64(n), dtype=np.uint64)
    for k in range(n):
        h = (h * _MULT) ^ (ids[k : len(ids) - n + 1 + k] + np.uint64(1))
    h = (h ^ (h >> np.uint64(31))) * _MIX
    return (h % np.uint64(dim)).astype(np.int64)


def featurize(ids: list[int] | tuple[int, ...], spec: FeatureSpec) -> np.ndarray:
    """[width] float32 features of one prompt."""
    out = np.zeros(spec.width, dtype=np.float32)
    arr = np.asarray(ids, dtype=np.uint64)
    counts = np.zeros(spec.dim, dtype=np.float32)
    for n in spec.ngrams:
        if len(arr) >= n:
            np.add.at(counts, _ngram_slots(arr, n, spec.dim), 1.0)
    counts = np.log1p(counts)
    norm = float(np.linalg.norm(counts))
    out[: spec.dim] = counts / norm if norm else counts
    length = len(ids)
    out[spec.dim + int(np.searchsorted(np.asarray(spec.length_bins), length, side="left"))] = 1.0
    out[-1] = np.log1p(length) / 10.0
    return out


def featurize_all(prompts: list[list[int]], spec: FeatureSpec) -> np.ndarray:
    """[N, width] features of N prompts."""
    return np.stack([featurize(p, spec) for p in prompts]) if prompts else np.zeros((0, spec.width), np.float32)
