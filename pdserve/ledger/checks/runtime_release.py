"""Check: the P/D runtime release manifest through rollback (spec 0x0FA-0x0FH).

Covers pinned sources, audited paths, connector direction/roles, the transfer capability
(allowed request plus denied probes with their reasons), the net-margin cells and the promoted
cell, promotion gates, fault outcomes, metric names, the release state path and the exact
rollback order.
`with_exposed_metrics` replaces the fixture's observability list with the names a live
server's Prometheus text exposes, so the check can be run against a running deployment.
"""

from __future__ import annotations

import re
from typing import Any

from pdserve.ledger.checks.common import expect_equal, expect_rounded, get, require, require_synthetic
from pdserve.ledger.margin import MarginTerms, net_margin_s, should_enable_pd
from pdserve.ledger.release import authorization_error, release_path_error, rollback_order_error

HEX40 = re.compile(r"^[0-9a-f]{40}$")
FAULT_OUTCOMES = {
    "mid_transfer": "ABORT_UNPUBLISHED",
    "stale_completion": "REJECT_STALE",
    "decode_crash": "REROUTE_OR_RECOMPUTE",
    "bad_capability": "DENY_BEFORE_REGISTRATION",
}
METRIC_PREFIX = "pdserve_"
REQUIRED_METRICS = {"pd_route_total", "kv_transfer_bytes", "kv_transfer_exposed_seconds", "kv_transfer_attempts_total", "kv_publication_rejects_total", "capability_denials_total", "slo_attainment", "fallback_total", "rollback_seconds"}


def exposed_metric_names(text: str, prefix: str = METRIC_PREFIX) -> set[str]:
    """Metric names a Prometheus text exposition offers, without `prefix`: every sample name and
    every family (`# TYPE`); a counter family answers to its name with and without `_total`, so
    a counter that has no labelled child yet still counts as exposed."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = (line.split() + [""])[:4]
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base, base + "_total"} if kind == "counter" else {name}
        elif line.strip() and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line.strip(), maxsplit=1)[0])
    return {n[len(prefix):] for n in names if n.startswith(prefix)}


def with_exposed_metrics(fx: dict, metrics_text: str) -> dict:
    """A copy of `fx` whose observability list is what `metrics_text` (a live /metrics) exposes."""
    return {**fx, "observability": sorted(exposed_metric_names(metrics_text))}


def _pins(fx: dict) -> None:
    pins = {p.get("name"): p for p in get(fx, "source_pins", list)}
    for name, pin in pins.items():
        require(bool(HEX40.match(str(pin.get("commit", "")))), f"pin {name} commit is not a 40-hex object id")
    seen = set()
    for entry in get(fx, "source_paths", list):
        require(entry.get("pin") in pins, f"path {entry.get('path')} cites unknown pin {entry.get('pin')!r}")
        require(bool(HEX40.match(str(entry.get("blob", "")))), f"path {entry.get('path')} has no 40-hex blob id")
        key = (entry["pin"], entry.get("path"))
        require(key not in seen, f"path {key} listed twice")
        seen.add(key)


def _connector(fx: dict) -> None:
    c = get(fx, "connector", dict)
    require(c.get("direction") in ("push", "pull"), f"connector direction {c.get('direction')!r} is not push or pull")
    roles = (c.get("producer_role"), c.get("consumer_role"))
    expect_equal("connector roles", roles, ("prefill", "decode"))


def _capability(fx: dict) -> str:
    cap, clock = get(fx, "capability", dict), get(fx, "capability_context", dict)
    args = (cap, clock["now_s"], clock["route_epoch"], clock["trusted_issuers"], clock["max_ttl_s"])
    error = authorization_error(get(fx, "transfer_request", dict), *args)
    require(error is None, f"the release's own transfer is denied: {error}")
    for probe in get(fx, "denied_probes", list):
        request = {**get(fx, "transfer_request"), **probe["change"]}
        reason = authorization_error(request, *args)
        require(reason is not None, f"probe {probe['name']!r} was allowed")
        require(probe["reason_contains"] in reason, f"probe {probe['name']!r} denied for {reason!r}, expected {probe['reason_contains']!r}")
    return "ALLOW_EXACT_REGIONS_ONLY"


def _cells(fx: dict) -> dict[str, Any]:
    margin_ms = get(fx, "sensitivity.safety_margin_ms")
    margins, enabled = {}, []
    for cell in get(fx, "sensitivity.cells", list):
        terms = MarginTerms(*(cell[k] / 1e3 for k in ("interference_saved_ms", "transfer_exposed_ms", "route_delta_ms", "failure_penalty_ms")))
        margins[cell["name"]] = net_margin_s(terms) * 1e3
        expect_rounded(f"cell {cell['name']} margin_ms", margins[cell["name"]], cell["expected_margin_ms"], 6)
        enable = should_enable_pd(terms, margin_ms / 1e3, cell["ttft_gate"], cell["tpot_gate"])
        expect_equal(f"cell {cell['name']} enable", enable, cell["expected_enable"])
        if enable:
            enabled.append(cell["name"])
    promoted = get(fx, "sensitivity.promoted_cell")
    require(promoted in enabled, f"promoted cell {promoted!r} does not clear the net-margin and SLO gates")
    return {"margins_ms": margins, "enabled_cells": enabled}


def _gates(fx: dict) -> None:
    g = get(fx, "gates", dict)
    for name in ("exactness_mismatches", "stale_publications", "unauthorized_accepted_transfers"):
        expect_equal(f"gate {name}", g.get(name), 0)
    require(g["canary_samples"] >= g["min_canary_samples"], f"only {g['canary_samples']} canary samples (need {g['min_canary_samples']})")
    for clock in ("ttft_attainment", "tpot_attainment"):
        require(g[clock] >= g["attainment_target"], f"gate {clock} {g[clock]} below target {g['attainment_target']}")
    require(g["transfer_failure_rate"] <= g["max_transfer_failure_rate"], "transfer failure rate above its bound")
    for flag in ("rollback_drill_passed", "fallback_healthy", "failure_injection_passed"):
        expect_equal(f"gate {flag}", g.get(flag), True)


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    _pins(fx)
    _connector(fx)
    authorization = _capability(fx)
    cells = _cells(fx)
    _gates(fx)
    outcomes = {f["fault"]: f["outcome"] for f in get(fx, "failure_outcomes", list)}
    expect_equal("failure outcomes", outcomes, FAULT_OUTCOMES)
    missing = REQUIRED_METRICS - set(get(fx, "observability", list))
    require(not missing, f"observability lacks {sorted(missing)}")
    states = get(fx, "release_states", list)
    path_error = release_path_error(states)
    require(path_error is None, str(path_error))
    order_error = rollback_order_error(get(fx, "rollback_steps", list))
    require(order_error is None, str(order_error))
    derived = {"authorization": authorization, **cells, "final_state": states[-1], "rollback_steps": len(get(fx, "rollback_steps"))}
    for key in ("final_state", "enabled_cells"):
        expect_equal(key, derived[key], get(fx, f"expected.{key}"))
    return derived
