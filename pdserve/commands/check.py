"""`pdserve check NAME [FIXTURE.json]`: run one of the spec's executable checks.

Prints the derived values; exits 1 with the reason when the fixture is inconsistent. Without a
fixture path the shipped fixture is used; `--list` names every check.
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
        derived = run_check(args.name, load_fixture(args.name, args.fixture))
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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("check", help="reproduce a spec worked example from a fixture")
    parser.add_argument("name", nargs="?", help="check name (see --list)")
    parser.add_argument("fixture", nargs="?", help="fixture JSON (default: the shipped one)")
    parser.add_argument("--list", action="store_true", help="list the available checks")
    parser.add_argument("--json", action="store_true", help="print derived values as JSON")
    parser.set_defaults(func=_run)
