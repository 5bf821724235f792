"""Check: the transfer-trace contract on a fixture written in the runtime's event schema.

The fixture holds one transaction's events; it must satisfy the contract in
`pdserve.ledger.trace` and reproduce the expected wall time, overlapped work, exposed stall
(microseconds, three decimals), retry count and logical/sent bytes.
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger.checks.common import CheckFailed, expect_equal, expect_rounded, get, require, require_synthetic
from pdserve.ledger.trace import TraceFormatError, analyze_trace, parse_event


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    try:
        events = [parse_event(e, i) for i, e in enumerate(get(fx, "events", list), start=1)]
    except TraceFormatError as exc:
        raise CheckFailed(str(exc)) from exc
    layers = set(get(fx, "expected_layers", list))
    reports = analyze_trace(events, layers)
    require(len(reports) == 1, f"fixture holds {len(reports)} transactions, expected one")
    report = reports[0]
    require(report.status == "published", f"transaction {report.transfer} rejected: {report.reason}")
    derived = {
        "status": report.status,
        "wall_us": report.wall_s * 1e6,
        "overlapped_us": report.overlapped_s * 1e6,
        "exposed_stall_us": None if report.exposed_stall_s is None else report.exposed_stall_s * 1e6,
        "retries": report.retries,
        "logical_bytes": report.logical_bytes,
        "sent_bytes": report.sent_bytes,
        "layers_visible": list(report.layers_visible),
    }
    require(derived["exposed_stall_us"] is not None, "trace has no decode_ready event")
    for key, value in derived.items():
        expected = get(fx, f"expected.{key}")
        if key.endswith("_us"):
            expect_rounded(key, value, expected, 3)
        else:
            expect_equal(key, value, expected)
    return derived
