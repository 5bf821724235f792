"""latency/tp_collectives.py: a real gloo group at TP 2 times its all_reduce and step broadcast
(values depend on the machine; the checks are the section's shape and that nothing timed is
free), and the section round-trips through a profile's JSON into the router's scaling."""

from __future__ import annotations

import json

from pdserve.latency.tp_collectives import (
    PREFILL_ROWS,
    CollectiveCosts,
    LayerShape,
    costs_from_timings,
    profile_section,
)
from pdserve.model.config import load_config
from pdserve.model.default import resolve_model
from pdserve.router.pricing.tp_pricing import scaling_for


def test_profile_section_measures_tp2_and_the_router_reads_it():
    section = json.loads(json.dumps(profile_section("tiny", "bfloat16", None, (2,))))
    assert len(section) == 1
    costs = CollectiveCosts.from_dict(section[0])
    assert costs.tp == 2 and costs.pinned is True
    assert costs.step_sync_s > 0 and costs.median_allreduce_s > 0 and costs.median_step_sync_s >= costs.step_sync_s
    assert costs.allreduce_s >= 0 and costs.allreduce_s_per_byte >= 0
    # engine-shaped (products between the calls): measured, and what the pricing reads
    assert costs.median_shaped_allreduce_s > 0 and costs.shaped_allreduce_s >= 0 and costs.shaped_allreduce_s_per_byte >= 0
    shaped = costs.engine_shaped()
    assert (shaped.allreduce_s, shaped.allreduce_s_per_byte) == (costs.shaped_allreduce_s, costs.shaped_allreduce_s_per_byte)
    assert shaped.step_sync_s == costs.step_sync_s and CollectiveCosts(2, True, 1.0, 0.0, 1.0).engine_shaped().allreduce_s == 1.0
    profile = {"prefill_coef": [0.004, 2.0e-4, 0.0], "decode_coef": [0.01, 1.0e-3, 0.0], "meta": {"threads": 1, "tp": 1},
               "collectives": section}
    scaling = scaling_for(load_config(resolve_model("tiny")), profile, threads_per_worker=1)
    assert scaling.collectives == (costs,) and scaling.costs_at(2) == shaped
    assert scaling.overhead(2).fixed_s == 16 * costs.shaped_allreduce_s + costs.step_sync_s  # tiny: 8 layers
    assert scaling.overhead(2).per_row_s == 16 * 1024 * costs.shaped_allreduce_s_per_byte  # rows of 512 bf16


def test_costs_from_timings_counts_each_call_kinds_own_row_bytes():
    """fp32 compute: the back-to-back calls move rows of 4 d bytes, the engine-shaped ones the
    products' bf16 partials (2 d bytes); each slope is per byte of what its calls moved."""
    d, alpha, beta = 512, 1e-4, 1e-9
    shape = LayerShape(hidden=d, q_dim=d, kv_dim=d // 4, intermediate=4 * d)
    line = lambda row_bytes, rows: alpha + rows * row_bytes * beta  # noqa: E731 - one call's seconds
    timed = {"small": [line(4 * d, 1)] * 3, "large": [line(4 * d, PREFILL_ROWS)] * 3, "sync": [2e-4, 3e-4, 4e-4],
             "shaped_small": [line(2 * d, 1)] * 3, "shaped_large": [line(2 * d, PREFILL_ROWS)] * 3}
    costs = costs_from_timings(2, True, timed, 4 * d, shape)
    for a, b in ((costs.allreduce_s, costs.allreduce_s_per_byte), (costs.shaped_allreduce_s, costs.shaped_allreduce_s_per_byte)):
        assert abs(a - alpha) < 1e-12 and abs(b - beta) < 1e-18
    assert costs.step_sync_s == 2e-4 and costs.median_step_sync_s == 3e-4
    unshaped = costs_from_timings(2, True, timed, 4 * d, None)
    assert unshaped.shaped_allreduce_s is None and unshaped.engine_shaped() == unshaped
    assert CollectiveCosts.from_dict(unshaped.to_dict()) == unshaped  # None survives the profile's JSON
    zero = CollectiveCosts(2, True, 1e-4, 1e-9, 1e-4, shaped_allreduce_s=0.0, shaped_allreduce_s_per_byte=2e-9)
    assert zero.engine_shaped().allreduce_s_per_byte == 2e-9  # a shaped alpha of 0 is a measurement, not "missing"
