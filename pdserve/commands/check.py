"""`pdserve check NAME [FIXTURE.json]`: run one of the spec's executable checks.

Prints the derived values; exits 1 with the reason when the fixture is inconsistent. Without a
fixture path the shipped fixture is used; `--list` names every check. `--metrics URL|FILE`
(runtime-release only) takes the fixture's observability list from a live server's /metrics.
"""

from __future__ import annotations

import argparse
import json


def _run(args: argparse.Namespace) -> int:
    from pdserve.ledger.checks import CHECKS, CheckFailed, load_fixture, run_check

    if args.list or not args.name:
        for name, (_, summary) in CHECKS.items():
            print(f"{name:<22}  {summary}")
        return 0 if args.list else 2
    try:
        fixture = load_fixture(args.name, args.fixture)
        if args.metrics:
            fixture = _with_live_metrics(args.name, fixture, args.metrics)
        derived = run_check(args.name, fixture)
    except CheckFailed as exc:
        print(f"FAIL {args.name}: {exc}")
        return 1
    if args.json:
        print(json.dumps({"check": args.name, "ok": True, "derived": derived}, default=str))
    else:
        print(f"PASS {args.name}")
        for key, value in derived.items():
            print(f"  {key}: {json.dumps(value, default=str)}")
    return 0


def _with_live_metrics(name: str, fixture: dict, source: str) -> dict:
    from urllib.request import urlopen

    from pdserve.ledger.checks import CheckFailed
    from pdserve.ledger.checks.runtime_release import with_exposed_metrics

    if name != "runtime-release":
        raise CheckFailed("--metrics applies to runtime-release only")
    try:
        if source.startswith(("http://", "https://")):
            with urlopen(source, timeout=10) as response:
                text = response.read().decode()
        else:
            with open(source) as f:
                text = f.read()
    except OSError as exc:
        raise CheckFailed(f"cannot read metrics from {source}: {exc}") from exc
    return with_exposed_metrics(fixture, text)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("check", help="reproduce a spec worked example from a fixture")
    parser.add_argument("name", nargs="?", help="check name (see --list)")
    parser.add_argument("fixture", nargs="?", help="fixture JSON (default: the shipped one)")
    parser.add_argument("--list", action="store_true", help="list the available checks")
    parser.add_argument("--json", action="store_true", help="print derived values as JSON")
    parser.add_argument("--metrics", metavar="URL|FILE", help="runtime-release: the metric names a live /metrics exposes")
    parser.set_defaults(func=_run)
