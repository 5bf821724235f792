"""DistServe's fitted A100 step times (its artifact's profiler JSON) as a pdserve latency model.

Contract: ``distserve:ENGINE:CHECKOUT`` (`DistServeSpec.parse`) names a LLMServe/DistServe checkout
supplied by the user (nothing of it ships with pdserve) and one of the two engines its artifact
profiled on A100-80GB SXM: ``distserve`` (its own engine, `profiler-a100-80g.distserve.json`) or
``vllm`` (vLLM 0.2, `profiler-a100-80g.vllm.json`), both under
``simdistserve/estimators/profile_data/``. `distserve_family(spec, model)` returns a function
(tp, pp) -> `DistServeLatency`. The fits and their form are DistServe's
(`simdistserve/estimators/time_estimator.py`), in ms, per tp:

- a prefill iteration of prompts n_i: f = a + b * sum(n_i) + c * sum(n_i ** 2); with pp stages each
  stage takes f / pp + pp (its `pp_const`), so the prompt's latency is f + pp ** 2;
- a decode iteration of B sequences whose visible lengths sum to L (DistServe's
  sum(context + 1)): a + b * L + c * B, with the (a, b, c) of ``decoding_smallbs`` below the
  fit's batch threshold and of ``decoding_largebs`` at or above it; each of pp stages takes 1/pp
  of it for its own micro-batch;
- DistServe's simulator adds 2 ms + 0.1 us per context token to every iteration of an instance's
  first stage (`Worker.add_ray_overhead`); it is added here too.

Mapped onto pdserve's contract (`base.py`): a decode step is a pipeline cycle, the full-stack
time of one micro-batch of ceil(B / pp) sequences plus pp first-stage overheads (the first stage
runs every micro-batch in turn); a prefill frees the first stage after its overhead plus 1/pp of
the rest (`prefill_stage_s`, taking the overhead as its 2 ms constant: the token part, at most a
fraction of a millisecond, is treated as pipelined); a prompt's c * n ** 2 term becomes
c * (2 * causal_pairs - n), equal for a whole prompt and counting cached rows as a chunk's pairs
do. A colocated chunk (which DistServe's vLLM never runs: it has no mixed batches) is priced as
one fused iteration on the same fits: the prefill fit over the chunk's rows plus the decode rows,
plus the decode fit's per-context-token term for the decode batch. K/V capacity: the checkout's
``max_num_tokens.csv`` for the tp x pp shape (0 where it has none, which takes the shape out of
the search); a tp without a fit for the model also has capacity 0 and raises if timed.

Errors are ValueErrors naming the missing path, engine, or model (with the models the file has).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from pdserve.latency.base import LatencyModel, causal_pairs
from pdserve.latency.geometry import ModelSpec

PROFILE_DIR = Path("simdistserve/estimators/profile_data")
ENGINES = ("distserve", "vllm")
CAPACITY_FILE = "max_num_tokens.csv"
FIRST_STAGE_MS = 2.0  # Worker.add_ray_overhead: base_overhead
FIRST_STAGE_MS_PER_TOKEN = 1e-4  # ... plus k per context token of the iteration

Coef = tuple[float, float, float]


@dataclass(frozen=True)
class DistServeSpec:
    """Which engine's fits, from which DistServe checkout."""

    engine: str
    checkout: str

    @classmethod
    def parse(cls, text: str) -> DistServeSpec:
        parts = text.split(":", 2)
        if parts[0] != "distserve" or len(parts) != 3 or not parts[2]:
            raise ValueError(f"latency model {text!r}: expected distserve:ENGINE:CHECKOUT, e.g. distserve:vllm:/src/DistServe")
        if parts[1] not in ENGINES:
            raise ValueError(f"latency model {text!r}: engine must be one of {ENGINES}, got {parts[1]!r}")
        return cls(parts[1], parts[2])

    @property
    def profile_file(self) -> Path:
        return Path(self.checkout) / PROFILE_DIR / f"profiler-a100-80g.{self.engine}.json"

    @property
    def capacity_file(self) -> Path:
        return Path(self.checkout) / PROFILE_DIR / CAPACITY_FILE

    def __str__(self) -> str:
        return f"distserve:{self.engine}:{self.checkout}"


@dataclass(frozen=True)
class StepFit:
    """One engine's fits at one tp (ms): prefill (a, per token, per squared prompt token); decode
    (a, per visible token, per sequence) below and at/above `threshold` sequences."""

    prefill: Coef
    decode_small: Coef
    decode_large: Coef
    threshold: int

    @classmethod
    def from_json(cls, d: dict) -> StepFit:
        def coef(key: str) -> Coef:
            a, b, c = (float(x) for x in d[key])
            return a, b, c

        return cls(coef("prefill"), coef("decoding_smallbs"), coef("decoding_largebs"),
                   int(d["decoding_large_small_bs_threshold"]))

    def decode(self, batch: int) -> Coef:
        return self.decode_small if batch < self.threshold else self.decode_large


def first_stage_ms(tokens: float) -> float:
    """DistServe's per-iteration overhead on an instance's first stage, `tokens` of context."""
    return FIRST_STAGE_MS + FIRST_STAGE_MS_PER_TOKEN * tokens


@dataclass(frozen=True)
class DistServeLatency(LatencyModel):
    """DistServe's fitted step times of one engine on a tp x pp instance (see the module contract)."""

    fit: StepFit | None  # None: the artifact has no fit at this tp
    tp: int
    pp: int
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    engine: str = "distserve"

    @property
    def pipeline_stages(self) -> int:  # type: ignore[override]
        return self.pp

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        rows = sum(new_tokens)
        square = sum(2 * causal_pairs(n, k) - n for n, k in zip(new_tokens, cached_tokens))
        return self._prefill_ms(rows, square, rows + sum(cached_tokens)) * 1e-3

    def prefill_stage_s(self, latency_s: float) -> float:
        """The first stage's hold: its overhead plus 1/pp of the rest."""
        overhead_s = FIRST_STAGE_MS * 1e-3
        return overhead_s + (latency_s - overhead_s) / self.pp

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        micro = -(-batch // self.pp)
        visible = context_tokens * micro / batch
        a, b, c = self._fit().decode(micro)
        cycle_ms = a + b * visible + c * micro + self.pp * first_stage_ms(visible - micro)
        return cycle_ms * 1e-3

    def mixed_step_s(self, chunk_tokens: int, chunk_pairs: int, chunk_kv_tokens: int, chunk_fraction: float,
                     batch: int, context_tokens: int) -> float:
        if chunk_tokens <= 0:
            return self.decode_step_s(batch, context_tokens)
        micro = -(-batch // self.pp) if batch > 0 else 0
        visible = context_tokens * micro / batch if batch > 0 else 0.0
        # the heaviest micro-batch (the chunk with its share of the decodes) paces the cycle
        ms = self._prefill_ms(chunk_tokens + micro, 2 * chunk_pairs - chunk_tokens, chunk_tokens + visible)
        if micro:
            ms += self._fit().decode(micro)[1] * visible + (self.pp - 1) * first_stage_ms(visible - micro)
        return ms * 1e-3

    def to_dict(self) -> dict:
        return {"kind": "distserve", "engine": self.engine, "tp": self.tp, "pp": self.pp}

    def _prefill_ms(self, rows: float, square: float, context: float) -> float:
        a, b, c = self._fit().prefill
        return a + b * rows + c * square + self.pp * self.pp + first_stage_ms(context)

    def _fit(self) -> StepFit:
        if self.fit is None:
            raise ValueError(f"DistServe's {self.engine} profile has no fit at tp{self.tp}")
        return self.fit


def distserve_family(spec: DistServeSpec, model: ModelSpec) -> Callable[[int, int], DistServeLatency]:
    """(tp, pp) -> `model`'s DistServeLatency from `spec`'s checkout (files read and checked here)."""
    fits = load_fits(spec, model)
    capacity = load_capacities(spec.capacity_file, fits.key)

    @lru_cache(maxsize=None)
    def family(tp: int, pp: int) -> DistServeLatency:
        fit = fits.by_tp.get(tp)
        cap = capacity.get((tp, pp), 0) if fit is not None else 0
        return DistServeLatency(fit, tp, pp, model.kv_bytes_per_token, cap, spec.engine)

    return family


@dataclass(frozen=True)
class ModelFits:
    key: str  # the model's name in DistServe's files, e.g. facebook/opt-13b
    by_tp: dict[int, StepFit]


def load_fits(spec: DistServeSpec, model: ModelSpec) -> ModelFits:
    """The fits of `model` in `spec`'s profiler JSON; ValueError naming what is missing."""
    path = spec.profile_file
    if not Path(spec.checkout).is_dir():
        raise ValueError(f"latency model {spec}: no DistServe checkout at {spec.checkout}")
    if not path.is_file():
        raise ValueError(f"latency model {spec}: {path} is missing (a LLMServe/DistServe checkout has it)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of models, got {type(data).__name__}")
    key = model_key(model, data)
    if key is None:
        raise ValueError(f"{path} has no fit for model {model.name!r} (it has: {', '.join(sorted(data))})")
    try:
        return ModelFits(key, {int(tp): StepFit.from_json(d) for tp, d in data[key].items()})
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed fit for {key} ({exc})") from exc


def model_key(model: ModelSpec, data: dict) -> str | None:
    """The entry of `data` naming `model`: its Hugging Face id, or any id ending in its name."""
    names = {model.name.lower(), (model.source or "").lower()}
    for key in data:
        if key.lower() in names or key.lower().rsplit("/", 1)[-1] in names:
            return key
    return None


def load_capacities(path: Path, key: str) -> dict[tuple[int, int], int]:
    """{(tp, pp): K/V tokens} for model `key` from DistServe's memory table (no row: no entry)."""
    if not path.is_file():
        raise ValueError(f"{path} is missing (DistServe's K/V capacity per shape)")
    with path.open() as f:
        try:
            return {(int(r["tp"]), int(r["pp"])): int(r["max_num_tokens"]) for r in csv.DictReader(f) if r["model"] == key}
        except (KeyError, TypeError, ValueError) as exc:  # a missing column, a short row, an empty number
            raise ValueError(f"{path}: malformed memory table ({type(exc).__name__}: {exc}); "
                             "expected columns model, tp, pp, max_num_tokens") from exc
