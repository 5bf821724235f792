"""Registry of the spec's executable checks and their shipped fixtures.

Each check module exposes `check(fixture: dict) -> dict` (derived values) and raises
CheckFailed with a specific reason on the first inconsistency. Fixtures ship as package data
in pdserve/ledger/fixtures/<module>.json.
"""

from __future__ import annotations

import importlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

from pdserve.ledger.checks.common import CheckFailed

CHECKS: dict[str, tuple[str, str]] = {
    "handoff-manifest": ("handoff_manifest", "identity, compute/transfer sets and logical bytes"),
    "phase-cost": ("phase_cost", "prefill/decode/mixed work vectors and lower bounds"),
    "transfer-protocol": ("transfer_protocol", "credits, coverage, producer/consumer gates, publication"),
    "distserve-placement": ("distserve_placement", "phase goodput, replicas, residency, links, stage packing"),
    "splitwise-pools": ("splitwise_pools", "JSQ, mixed capacity, FCFS batching, layer visibility, roles"),
    "alternative-pipelines": ("alternative_pipelines", "KV-Runahead partitions and TetriInfer placement"),
    "distributed-kv-memory": ("distributed_kv_memory", "MemServe pool ordering and Mooncake routing"),
    "transfer-trace": ("transfer_trace", "transfer-trace contract, overlap and exposed stall"),
    "runtime-release": ("runtime_release", "release manifest, capabilities, margins, rollback order"),
}

__all__ = ["CHECKS", "CheckFailed", "fixture_text", "load_fixture", "run_check"]


def _module_name(name: str) -> str:
    if name not in CHECKS:
        raise CheckFailed(f"unknown check {name!r}; known: {', '.join(CHECKS)}")
    return CHECKS[name][0]


def fixture_text(name: str) -> str:
    """The shipped fixture for check `name`, as text."""
    return resources.files("pdserve.ledger").joinpath("fixtures", f"{_module_name(name)}.json").read_text()


def load_fixture(name: str, path: str | Path | None = None) -> dict[str, Any]:
    """Parse `path`, or the shipped fixture when `path` is None."""
    try:
        text = fixture_text(name) if path is None else Path(path).read_text()
        data = json.loads(text)
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise CheckFailed(f"cannot read fixture: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckFailed("a fixture must be a JSON object")
    return data


def run_check(name: str, fixture: dict[str, Any]) -> dict[str, Any]:
    """Run check `name`; malformed fixtures (missing or mistyped fields) become CheckFailed."""
    module = importlib.import_module(f"pdserve.ledger.checks.{_module_name(name)}")
    declared = fixture.get("check", name)
    if declared != name:
        raise CheckFailed(f"fixture is for check {declared!r}, not {name!r}")
    try:
        return module.check(fixture)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        raise CheckFailed(f"malformed fixture: {type(exc).__name__}: {exc}") from exc
