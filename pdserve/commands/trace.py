"""`pdserve trace analyze TRACE.jsonl`: apply the transfer-trace contract to a runtime trace.

One row per transaction (transfer id): status, wall time, overlapped work, retries, exposed
stall and bytes. Exits 1 when any transaction breaks the contract, 2 on an unreadable trace.
Given the router's request trace instead (`--trace-dir`'s requests.jsonl: lines that carry
`prompt_tokens`), it summarises the per-request P/D decisions by prompt-length bucket.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from pdserve import argtypes

COLUMNS = ("transfer", "request", "generation", "status", "wall_us", "overlap_us", "retries", "exposed_us", "logical_bytes", "sent_bytes")


def _row(report) -> dict:
    stall = report.exposed_stall_s
    return {
        "transfer": report.transfer,
        "request": report.request,
        "generation": report.generation,
        "status": report.status,
        "wall_us": round(report.wall_s * 1e6, 3),
        "overlap_us": round(report.overlapped_s * 1e6, 3),
        "retries": report.retries,
        "exposed_us": "-" if stall is None else round(stall * 1e6, 3),
        "logical_bytes": report.logical_bytes,
        "sent_bytes": report.sent_bytes,
    }


def _print_table(reports) -> None:
    rows = [_row(r) for r in reports]
    widths = {c: max([len(c)] + [len(str(row[c])) for row in rows]) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in COLUMNS))
    for report in reports:
        if not report.ok:
            print(f"REJECTED {report.transfer}: {report.reason}")


PROMPT_BUCKETS = (64, 256, 1024, 4096)  # upper bounds (exclusive) of the prompt-length buckets


def bucket(prompt_tokens: int) -> str:
    lower = 0
    for upper in PROMPT_BUCKETS:
        if prompt_tokens < upper:
            return f"{lower}-{upper - 1}"
        lower = upper
    return f"{lower}+"


def decision_summary(records: list[dict]) -> dict[str, dict[str, int]]:
    """{prompt bucket: {decision: requests}} over request-trace lines that carry a P/D decision."""
    summary: dict[str, dict[str, int]] = {}
    for record in records:
        decision = record.get("pd_decision")
        if decision is not None and "prompt_tokens" in record:
            counts = summary.setdefault(bucket(int(record["prompt_tokens"])), {})
            counts[decision] = counts.get(decision, 0) + 1
    return summary


def _request_trace(path: str) -> list[dict] | None:
    """The file's records when it is a router request trace, else None (a transfer trace)."""
    with open(path, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    try:
        records = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        return None
    return records if records and all(isinstance(r, dict) and "request_id" in r and "event" not in r for r in records) else None


def _print_decisions(summary: dict[str, dict[str, int]]) -> None:
    print("prompt_tokens  disaggregate  local")
    for name, counts in summary.items():
        print(f"{name:<13}  {counts.get('disaggregate', 0):<12}  {counts.get('local', 0)}")


def _analyze(args: argparse.Namespace) -> int:
    from pdserve.ledger.trace import TraceFormatError, analyze_trace, parse_jsonl

    try:
        requests = _request_trace(args.trace)
        summary = decision_summary(requests) if requests is not None else None
    except (OSError, ValueError, TypeError) as exc:  # unreadable, not UTF-8, a prompt_tokens that is no count
        print(f"pdserve trace: {exc}")
        return 2
    if summary is not None:
        if args.json:
            print(json.dumps({"pd_decisions": summary}))
        else:
            _print_decisions(summary)
        return 0
    try:
        with open(args.trace, encoding="utf-8") as handle:
            events = parse_jsonl(handle)
    except (OSError, UnicodeDecodeError, TraceFormatError) as exc:
        print(f"pdserve trace: {exc}")
        return 2
    layers = set(range(args.layers)) if args.layers is not None else None
    reports = analyze_trace(events, layers)
    if args.json:
        print(json.dumps({"transactions": [asdict(r) for r in reports], "ok": all(r.ok for r in reports)}))
    else:
        _print_table(reports)
    return 0 if all(r.ok for r in reports) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("trace", help="analyze runtime transfer traces")
    sub = parser.add_subparsers(dest="trace_command", metavar="TRACE")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    analyze = sub.add_parser("analyze", help="check the transfer-trace contract and report timing")
    analyze.add_argument("trace", help="JSON-lines trace written by the runtime")
    analyze.add_argument("--layers", type=argtypes.positive_int, default=None, help="require layers 0..N-1 visible before publication")
    analyze.add_argument("--json", action="store_true", help="print one JSON object")
    analyze.set_defaults(func=_analyze)
