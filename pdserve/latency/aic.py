"""NVIDIA's measured per-step latencies, through aiconfigurator, as a pdserve latency model.

Contract: ``aic:SYSTEM[:BACKEND[:VERSION]]`` (`AicSpec.parse`; backend ``trtllm`` and the
database's current version by default) names one of aiconfigurator's performance databases
(kernel timings measured on the GPU type, e.g. ``h200_sxm``, ``h100_sxm``, ``a100_sxm``).
`aic_family(spec, model)` returns a function (tp, pp) -> `AicLatency` for that model. Each
`AicLatency` answers the latency-model contract (`base.py`) from aiconfigurator's compiled
engine step estimates:

- a prefill batch: ``predict_prefill_latency(batch, mean prompt, mean cached prefix)``;
- a decode iteration: ``decode_step_latency(batch, s - 1, 1)``, which aiconfigurator evaluates at
  s = isl + osl // 2 + 1 tokens per sequence, i.e. at the batch's mean visible length s;
- a colocated iteration: ``mixed_step_latency(chunk, batch, prompt, osl, 0)`` with the chunk's
  prompt length = chunk / fraction and osl chosen so the decode attention sees the batch's mean
  length (when that is shorter than the prompt, the prompt's length: a small over-estimate).

Lengths are evaluated on a geometric grid (8 points per doubling) and interpolated linearly,
and every grid answer is cached: the simulator asks millions of times, aiconfigurator answers
in tens of microseconds. Pipeline parallelism: `pipeline_stages` = pp (a prefill frees the first
stage after latency / pp); the step times are aiconfigurator's own for the tp x pp shape. K/V
capacity: (tp * pp * 0.9 * GPU memory from the system file - weights) / K/V bytes per token.

aiconfigurator is optional (``pip install pdserve[aic]``): `require_aic` raises a ValueError
naming the extra when it is absent; an unknown system, backend, version or model architecture
raises a ValueError listing what the database has.
"""

from __future__ import annotations

import importlib.util
from bisect import bisect_left
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from pdserve.latency.base import LatencyModel
from pdserve.latency.geometry import ModelSpec

GRID_PER_DOUBLING = 8
MEMORY_UTILIZATION = 0.9
# pdserve's hardware profile (node size, NIC, NVLink: the K/V transfer side) for an aic system
HARDWARE_OF = {"h200_sxm": "h200", "h100_sxm": "h100", "a100_sxm": "a100-80g"}
MISSING = "the aic latency model needs aiconfigurator: pip install 'pdserve[aic]' (or pip install aiconfigurator)"


@dataclass(frozen=True)
class AicSpec:
    """Which database: GPU system, serving backend and database version (None: current)."""

    system: str
    backend: str = "trtllm"
    version: str | None = None

    @classmethod
    def parse(cls, text: str) -> AicSpec:
        parts = text.split(":")
        if parts[0] != "aic" or not 2 <= len(parts) <= 4 or not all(parts[1:]):
            raise ValueError(f"latency model {text!r}: expected aic:SYSTEM[:BACKEND[:VERSION]], e.g. aic:h200_sxm")
        return cls(parts[1], *parts[2:])

    def __str__(self) -> str:
        return ":".join(["aic", self.system, self.backend] + ([self.version] if self.version else []))


def require_aic() -> None:
    """Raise a ValueError naming the optional extra when aiconfigurator is not installed."""
    if importlib.util.find_spec("aiconfigurator_core") is None:
        raise ValueError(MISSING)


def aic_family(spec: AicSpec, model: ModelSpec) -> Callable[[int, int], AicLatency]:
    """(tp, pp) -> the model's AicLatency on `spec`'s database (validated once, here)."""
    require_aic()
    _silence_provenance_warnings()
    database, version = _database(spec)
    model_path = _model_path(model)
    memory = float(database.system_spec["gpu"]["mem_capacity"])

    @lru_cache(maxsize=None)  # one model per shape, so its cache of grid answers is shared
    def family(tp: int, pp: int) -> AicLatency:
        return AicLatency(spec, version, model, _handle(database, model_path, tp, pp), tp, pp, memory)

    family(1, 1)  # an unsupported architecture fails now, with its name
    return family


class AicLatency(LatencyModel):
    """aiconfigurator's step estimates for one tp x pp instance (see the module contract)."""

    def __init__(self, spec: AicSpec, version: str, model: ModelSpec, handle, tp: int, pp: int, memory_bytes: float):
        self.spec, self.version, self.model, self.tp, self.pp = spec, version, model, tp, pp
        self._handle = handle
        free = tp * pp * memory_bytes * MEMORY_UTILIZATION - model.total_weight_bytes
        self._capacity = max(0, int(free // model.kv_bytes_per_token))
        self._decode_ms = lru_cache(maxsize=None)(self._decode_point_ms)
        self._prefill_ms = lru_cache(maxsize=None)(self._prefill_point_ms)
        self._mixed_s: dict[tuple[int, int, int, int], float] = {}

    @property
    def pipeline_stages(self) -> int:  # type: ignore[override]
        return self.pp

    @property
    def kv_bytes_per_token(self) -> int:  # type: ignore[override]
        return self.model.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:  # type: ignore[override]
        return self._capacity

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        n = len(new_tokens)
        prompt = (sum(new_tokens) + sum(cached_tokens)) / n
        prefix = 64 * math.floor(sum(cached_tokens) / n / 64)  # below every grid point the prompt lies between
        return _on_grid(lambda g: self._prefill_ms(n, g, min(prefix, g - 1)), prompt) * 1e-3

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return _on_grid(lambda g: self._decode_ms(batch, g), context_tokens / batch) * 1e-3

    def decode_segment_s(self, batch: int, context_tokens: int) -> tuple[float, float]:
        """Both steps of a segment from one bracket when they share its linear piece."""
        if batch <= 0:
            return 0.0, 0.0
        x = context_tokens / batch
        lo, hi = _bracket(x)
        if lo < hi and x + 1 <= hi:
            f_lo, f_hi = self._decode_ms(batch, lo), self._decode_ms(batch, hi)
            slope = (f_hi - f_lo) / (hi - lo)
            return (f_lo + slope * (x - lo)) * 1e-3, slope * 1e-3
        return super().decode_segment_s(batch, context_tokens)

    def mixed_step_s(self, chunk_tokens: int, chunk_pairs: int, chunk_kv_tokens: int, chunk_fraction: float,
                     batch: int, context_tokens: int) -> float:
        if chunk_tokens <= 0:
            return self.decode_step_s(batch, context_tokens)
        # the simulator's hottest call: grid points by bisection, inline, then one dict lookup
        prompt = chunk_tokens / chunk_fraction if chunk_fraction > 0 else chunk_tokens
        if prompt < chunk_tokens:
            prompt = chunk_tokens
        osl = 2 * (context_tokens / batch - prompt) if batch else 1
        key = (chunk_tokens, batch, _AT_OR_ABOVE[bisect_left(_GRID, prompt)],
               _AT_OR_ABOVE[bisect_left(_GRID, osl)] if osl > 1 else 1)
        step = self._mixed_s.get(key)
        if step is None:
            step = self._mixed_s[key] = self._mixed_point_ms(*key) * 1e-3
        return step

    def to_dict(self) -> dict:
        return {"kind": "aic", "spec": str(self.spec), "version": self.version, "model": self.model.name,
                "tp": self.tp, "pp": self.pp}

    def _decode_point_ms(self, batch: int, length: int) -> float:
        return self._handle.decode_step_latency(batch, max(1, length - 1), 1)

    def _prefill_point_ms(self, batch: int, prompt: int, prefix: int) -> float:
        return self._handle.predict_prefill_latency(batch, prompt, prefix)

    def _mixed_point_ms(self, chunk: int, batch: int, prompt: int, osl: int) -> float:
        return self._handle.mixed_step_latency(chunk, batch, max(prompt, chunk), osl, 0)


# integers up to 16, then 8 points per doubling up to 2 ** 24 tokens
_GRID = tuple(sorted({*range(1, 17), *(round(2 ** (k / GRID_PER_DOUBLING)) for k in range(4 * GRID_PER_DOUBLING,
                                                                                          24 * GRID_PER_DOUBLING + 1))}))
_AT_OR_ABOVE = _GRID + (_GRID[-1],)  # indexed by bisect_left(_GRID, x): the grid point at or above x, the last past it


def _bracket(x: float) -> tuple[int, int]:
    """The grid points around x (both x when x is one)."""
    i = bisect_left(_GRID, x)
    if i == len(_GRID):
        raise ValueError(f"aic latency model: {x:g} tokens is past the grid's {_GRID[-1]}")
    hi = _GRID[i]
    return (hi, hi) if hi == x or i == 0 else (_GRID[i - 1], hi)


def _on_grid(f: Callable[[int], float], x: float) -> float:
    """f at x, interpolated linearly between the grid points around it."""
    lo, hi = _bracket(x)
    if hi <= lo:
        return f(hi)
    w = (x - lo) / (hi - lo)
    return (1 - w) * f(lo) + w * f(hi)


def _database(spec: AicSpec):
    from aiconfigurator_core.sdk.perf_database import get_database, get_supported_databases

    supported = get_supported_databases()
    backends = supported.get(spec.system)
    if not backends:
        raise ValueError(f"aiconfigurator has no database for system {spec.system!r} (it has: {', '.join(sorted(supported))})")
    versions = list(backends.get(spec.backend, ()))
    if not versions:
        raise ValueError(f"aiconfigurator has no {spec.backend!r} data for {spec.system} (backends: {', '.join(sorted(backends))})")
    version = spec.version or _current_version(spec, versions)
    with _quiet():
        try:
            database = get_database(spec.system, spec.backend, version)
        except ValueError as exc:
            raise ValueError(f"aiconfigurator: {spec.system}/{spec.backend} has no version {version!r} "
                             f"(versions: {', '.join(versions)})") from exc
    if database is None:
        raise ValueError(f"aiconfigurator: {spec.system}/{spec.backend}/{version} could not be loaded")
    return database, version


def _current_version(spec: AicSpec, versions: list[str]) -> str:
    from aiconfigurator_core.sdk.perf_database import get_latest_database_version

    return get_latest_database_version(spec.system, spec.backend) or versions[-1]


def _handle(database, model_path: str, tp: int, pp: int):
    from aiconfigurator_core.sdk import config
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.rust_engine_step import _cached_engine_handle

    with _quiet():
        try:
            model = get_model(model_path, config.ModelConfig(tp_size=tp, pp_size=pp), database.backend)
            return _cached_engine_handle(model, database)
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise ValueError(f"aiconfigurator cannot model {model_path} at tp{tp}pp{pp}: {exc}") from exc


@lru_cache(maxsize=None)
def _config_dir(config_file: str) -> str:
    """A directory holding `config_file` as config.json (aiconfigurator reads a directory)."""
    out = Path(tempfile.mkdtemp(prefix="pdserve-aic-"))
    shutil.copyfile(config_file, out / "config.json")
    return str(out)


def _model_path(model: ModelSpec) -> str:
    if model.source is None:
        raise ValueError(f"the aic latency model needs a model config.json or a Hugging Face id, not the built-in {model.name!r}")
    path = Path(model.source)
    if not path.exists():
        return model.source  # a Hugging Face id aiconfigurator ships
    return str(path.parent) if path.name == "config.json" else _config_dir(str(path))


class _quiet:
    """Keep aiconfigurator's loggers at ERROR inside the block (it logs data-provenance warnings
    at WARNING on every database load)."""

    NAMES = ("aiconfigurator", "aiconfigurator_core")

    def __enter__(self):
        self._levels = [(logging.getLogger(n), logging.getLogger(n).level) for n in self.NAMES]
        for logger, _ in self._levels:
            logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        for logger, level in self._levels:
            logger.setLevel(level)


def _silence_provenance_warnings() -> None:
    """Its step queries warn too (once per new shape, e.g. an unknown attention lane); a level set
    per query clears logging's caches every time, so the aic model sets it once per process."""
    for name in _quiet.NAMES:
        logging.getLogger(name).setLevel(logging.ERROR)
