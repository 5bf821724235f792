"""Token-length distributions and their one-line SPEC syntax.

SPEC is ``KIND:ARGS`` with comma-separated numbers:

- ``fixed:N``            every request has N tokens;
- ``uniform:LO,HI``      integers drawn uniformly from [LO, HI], both ends included;
- ``normal:MEAN,STD``    rounded normal samples;
- ``lognormal:MU,SIGMA`` rounded exp(normal(MU, SIGMA)) samples (MU, SIGMA of the log).

Contract: every sample is clipped to [1, max_len] so a request always has at least one token;
sampling is a pure function of the spec and the numpy Generator passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPEC_HELP = (
    "length SPEC: fixed:N | uniform:LO,HI (inclusive) | normal:MEAN,STD | lognormal:MU,SIGMA "
    "(of the log); samples are rounded and clipped to >= 1"
)
_ARITY = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}


@dataclass(frozen=True)
class LengthSpec:
    """A parsed length distribution."""

    kind: str
    params: tuple[float, ...]
    max_len: int = 1 << 20

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{p:g}" for p in self.params)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` integer lengths, each in [1, max_len]."""
        raw = _draw(self.kind, self.params, rng, n)
        return np.clip(np.rint(raw), 1, self.max_len).astype(np.int64)


def parse_length_spec(spec: str) -> LengthSpec:
    """Parse ``KIND:ARGS``; a bare integer means ``fixed:N``. Raises ValueError on bad input."""
    text = spec.strip()
    if ":" not in text:
        text = f"fixed:{text}"
    kind, _, args = text.partition(":")
    kind = kind.strip().lower()
    if kind not in _ARITY:
        raise ValueError(f"unknown length distribution {kind!r}; {SPEC_HELP}")
    params = tuple(float(a) for a in args.split(",") if a.strip())
    if len(params) != _ARITY[kind]:
        raise ValueError(f"{kind} takes {_ARITY[kind]} number(s), got {args!r}")
    _validate(kind, params)
    return LengthSpec(kind=kind, params=params)


def fixed(n: int) -> LengthSpec:
    """Shorthand for ``fixed:n``."""
    return LengthSpec(kind="fixed", params=(float(n),))


def _validate(kind: str, params: tuple[float, ...]) -> None:
    if not all(np.isfinite(params)):
        raise ValueError(f"{kind} needs finite numbers, got {params}")
    if kind in ("fixed", "uniform") and params[-1] > LengthSpec.max_len:
        raise ValueError(f"{kind} lengths above {LengthSpec.max_len} tokens are not drawn (every sample is clipped there)")
    if kind == "fixed" and params[0] < 1:
        raise ValueError("fixed length must be >= 1")
    if kind == "uniform" and not 1 <= params[0] <= params[1]:
        raise ValueError("uniform needs 1 <= LO <= HI")
    if kind in ("normal", "lognormal") and params[1] < 0:
        raise ValueError(f"{kind} needs a non-negative spread")


def _draw(kind: str, params: tuple[float, ...], rng: np.random.Generator, n: int) -> np.ndarray:
    if kind == "fixed":
        return np.full(n, params[0])
    if kind == "uniform":
        return rng.integers(int(params[0]), int(params[1]) + 1, size=n)
    if kind == "normal":
        return rng.normal(params[0], params[1], size=n)
    return rng.lognormal(params[0], params[1], size=n)
