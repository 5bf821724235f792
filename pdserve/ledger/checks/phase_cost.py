"""Check: prefill, decode and mixed work vectors and their lower bounds (spec 0x02A-0x02B).

Integer work terms must match exactly; bounds are compared in microseconds and the dilation
as a ratio, both at three decimals (the precision the spec prints).
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger.checks.common import (
    expect_equal,
    expect_rounded,
    get,
    integer,
    ledger_errors,
    number,
    require,
    require_synthetic,
)
from pdserve.ledger.phase import (
    BlockGeometry,
    PhaseWork,
    bound_side,
    decode_work,
    lower_bound_s,
    mixed_work,
    prefill_work,
)

GEOMETRY = ("layers", "d_model", "d_ff", "q_heads", "kv_heads", "head_dim", "dtype_bytes")
WORK_FIELDS = ("flops", "causal_pairs", "new_rows", "weight_bytes", "kv_read_bytes", "kv_write_bytes")


def _geometry(fx: dict) -> BlockGeometry:
    values = [integer(fx, f"geometry.{k}", minimum=1) for k in GEOMETRY]
    require(get(fx, "geometry.q_heads") % get(fx, "geometry.kv_heads") == 0, "q_heads must be a multiple of kv_heads")
    return BlockGeometry(*values)


def _compare_work(name: str, work: PhaseWork, lb_s: float, side: str, fx: dict) -> dict[str, Any]:
    derived = {field: getattr(work, field) for field in WORK_FIELDS}
    for field, value in derived.items():
        expect_equal(f"{name}.{field}", value, get(fx, f"expected.{name}.{field}"))
    expect_equal(f"{name}.side", side, get(fx, f"expected.{name}.side", str))
    expect_rounded(f"{name}.lb_us", lb_s * 1e6, number(fx, f"expected.{name}.lb_us"), 3)
    return {**derived, "side": side, "lb_us": lb_s * 1e6}


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    geometry = _geometry(fx)
    flops_per_s = number(fx, "rates.flops_per_s", minimum=1)
    bytes_per_s = number(fx, "rates.bytes_per_s", minimum=1)
    lengths = get(fx, "decode.visible_lengths", list)
    require(len(lengths) > 0, "decode needs at least one sequence")
    with ledger_errors():
        prefill = prefill_work(geometry, integer(fx, "prefill.new_rows", 1), integer(fx, "prefill.visible_before", 0))
        decode = decode_work(geometry, lengths)
    mixed = mixed_work([prefill, decode])
    expect_equal("params_per_layer", geometry.params_per_layer, get(fx, "expected.params_per_layer"))
    expect_equal("kv_bytes_per_token", geometry.kv_bytes_per_token, get(fx, "expected.kv_bytes_per_token"))
    derived: dict[str, Any] = {"params_per_layer": geometry.params_per_layer, "kv_bytes_per_token": geometry.kv_bytes_per_token}
    bounds = {}
    for name, work in (("prefill", prefill), ("decode", decode), ("mixed", mixed)):
        bounds[name] = lower_bound_s(work, flops_per_s, bytes_per_s)
        side = bound_side(work, flops_per_s, bytes_per_s)
        derived[name] = _compare_work(name, work, bounds[name], side, fx)
    compute_floor = max(prefill.flops, decode.flops) / flops_per_s
    require(bounds["mixed"] >= compute_floor, "mixed bound is below a part's compute term")
    dilation = bounds["mixed"] / bounds["decode"]
    expect_rounded("dilation", dilation, number(fx, "expected.dilation"), 3)
    derived["dilation"] = dilation
    return derived
