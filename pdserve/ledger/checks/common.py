"""Shared helpers for fixture checks: typed field access and comparisons that fail with reasons.

A check is `check(fixture: dict) -> dict` returning derived values; it raises CheckFailed
with a specific, human-readable reason at the first inconsistency.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence


class CheckFailed(Exception):
    """A fixture contradicts the ledger; the message says which field and why."""


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise CheckFailed(reason)


def get(fixture: Mapping[str, Any], path: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """Value at dotted `path`; missing keys or a wrong type are check failures."""
    node: Any = fixture
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise CheckFailed(f"missing field {path}")
        node = node[part]
    if kind is not None:
        bad_bool = isinstance(node, bool) and kind in (int, float, (int, float))
        if bad_bool or not isinstance(node, kind):
            raise CheckFailed(f"field {path} has type {type(node).__name__}")
    return node


def number(fixture: Mapping[str, Any], path: str, minimum: float | None = None) -> float:
    value = get(fixture, path, (int, float))
    if minimum is not None and value < minimum:
        raise CheckFailed(f"field {path} = {value} is below {minimum}")
    return value


def integer(fixture: Mapping[str, Any], path: str, minimum: int | None = None) -> int:
    value = get(fixture, path, int)
    if minimum is not None and value < minimum:
        raise CheckFailed(f"field {path} = {value} is below {minimum}")
    return value


def expect_equal(label: str, derived: Any, expected: Any) -> None:
    require(derived == expected, f"{label}: derived {derived!r} but fixture says {expected!r}")


def expect_rounded(label: str, derived: float, expected: float, digits: int) -> None:
    """Compare at the fixture's printed precision (`digits` decimals)."""
    require(
        math.isclose(round(derived, digits), round(expected, digits), abs_tol=10 ** -(digits + 3)),
        f"{label}: derived {derived:.{digits + 3}f} rounds to {round(derived, digits)} but fixture says {expected}",
    )


def require_synthetic(fixture: Mapping[str, Any]) -> None:
    """Shipped fixtures are arithmetic tests; none may claim to be a measurement."""
    label = get(fixture, "evidence", str)
    require(label == "synthetic", f"evidence label {label!r}: a fixture check can only support synthetic claims")


def require_order(label: str, times: Sequence[tuple[str, float]]) -> None:
    """Named timestamps must be non-decreasing in the given order."""
    for (a, ta), (b, tb) in zip(times, times[1:]):
        require(ta <= tb, f"{label}: {b} at {tb} precedes {a} at {ta}")



@contextmanager
def ledger_errors() -> Iterator[None]:
    """Within this block a ValueError raised by a ledger function becomes a CheckFailed."""
    try:
        yield
    except ValueError as exc:
        raise CheckFailed(str(exc)) from exc
