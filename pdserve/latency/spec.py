"""What `--latency-model` names: a JSON file (one model), or ``aic:...`` or ``distserve:...`` (a
model per TP x PP shape).

Contract: `resolve_latency(text, model)` returns (fixed, family): for a file, the model it holds
and None (the planner then searches tp1pp1 only, as the file was measured there); for
``aic:SYSTEM[:BACKEND[:VERSION]]``, None and a function (tp, pp) -> LatencyModel (the planner
searches every shape); likewise for ``distserve:ENGINE:CHECKOUT`` (DistServe's fitted A100 step
times of its own engine or of vLLM 0.2, `distserve_fit.py`). Errors are ValueErrors that name the
file, the spec or the missing extra.
"""

from __future__ import annotations

from typing import Callable

from pdserve.latency.aic import AicSpec, aic_family
from pdserve.latency.base import LatencyModel
from pdserve.latency.distserve_fit import DistServeSpec, distserve_family
from pdserve.latency.geometry import ModelSpec
from pdserve.latency.load import load_latency_model

LatencyFamily = Callable[[int, int], LatencyModel]  # (tp, pp) -> the latency model of that shape


def is_family(text: str) -> bool:
    return text.startswith(("aic:", "distserve:"))


def resolve_latency(text: str, model: ModelSpec | None) -> tuple[LatencyModel | None, LatencyFamily | None]:
    """(fixed model, None) for a JSON file; (None, family) for an ``aic:`` or ``distserve:`` spec
    (needs `model`)."""
    if not is_family(text):
        return load_latency_model(text), None
    if model is None:
        raise ValueError(f"latency model {text!r} needs --model (the geometry whose steps it times)")
    if text.startswith("distserve:"):
        return None, distserve_family(DistServeSpec.parse(text), model)
    return None, aic_family(AicSpec.parse(text), model)
