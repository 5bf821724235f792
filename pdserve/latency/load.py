"""Reading a latency model from its JSON form (`--latency-model FILE.json`).

Contract: `latency_from_dict` builds a ``constant``, ``roofline`` or ``profiled`` model from its
`to_dict` form and raises ValueError on an unknown kind; `load_latency_model` reads a file and
turns a malformed one into a ValueError naming the file. (``aic:SYSTEM`` specs are not files:
`pdserve.latency.spec` tells the two apart.) The top of the latency package: it imports the
model modules, none of them imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.latency.base import ConstantLatency, LatencyModel
from pdserve.latency.profiled import ProfiledLatency
from pdserve.latency.roofline import roofline_from_dict

LATENCY_KINDS = ("constant", "roofline", "profiled")


def latency_from_dict(d: dict) -> LatencyModel:
    """Build a latency model from its JSON form; raises ValueError on an unknown kind."""
    kind = d.get("kind")
    if kind == "constant":
        return ConstantLatency(
            prefill_ms=float(d["prefill_ms"]),
            decode_step_ms=float(d["decode_step_ms"]),
            kv_bytes_per_token=int(d.get("kv_bytes_per_token", 0)),
            kv_capacity_tokens=_optional_int(d.get("kv_capacity_tokens")),
        )
    if kind == "profiled":
        return ProfiledLatency.from_dict(d)
    if kind == "roofline":
        return roofline_from_dict(d)
    raise ValueError(f"latency model kind must be one of {LATENCY_KINDS}, got {kind!r}")


def load_latency_model(path: str | Path) -> LatencyModel:
    """Read a latency model JSON file; an unreadable, non-JSON or malformed one (missing fields,
    a number that is not finite, a negative time) is a ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a latency model ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a latency model is a JSON object, got {type(data).__name__}")
    bad = _first_bad_number(data)
    if bad is not None:
        raise ValueError(f"{path}: malformed latency model ({bad[0]} = {bad[1]!r}: every number must be finite and >= 0)")
    try:
        return latency_from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed latency model ({exc})") from exc


def _first_bad_number(value, where: str = "") -> tuple[str, float] | None:
    """(path, value) of the first number that is NaN, infinite or negative."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        bad = isinstance(value, float | int) and not isinstance(value, bool) and not 0 <= value < float("inf")
        return (where, value) if bad else None
    for key, item in items:
        found = _first_bad_number(item, f"{where}.{key}" if where and not str(key).startswith("[") else f"{where}{key}")
        if found is not None:
            return found
    return None


def _optional_int(value) -> int | None:
    return None if value is None else int(value)
