"""The `pdserve` command line.

Every module in `pdserve.commands` that defines `register(subparsers)` contributes one or more
subcommands. Registration must stay cheap (argparse only); heavy imports (torch, ray, fastapi)
happen inside the handler a subcommand sets as `func`, so `pdserve ledger ...` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from pdserve import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"pdserve.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.cli_argv = list(sys.argv[1:] if argv is None else argv)  # what was typed (serve --config: typed flags win)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
