"""The `pdserve` command line.

Every module in `pdserve.commands` that defines `register(subparsers)` contributes one or more
subcommands. Registration must stay cheap (argparse only); heavy imports (torch, ray, fastapi)
happen inside the handler a subcommand sets as `func`, so `pdserve ledger ...` never loads torch.
A module without `def register(` in its source is a helper of a command (bench_fetch, torch at
import) and is not imported to build the parser.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys

from pdserve import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not _registers(info.name):
            continue
        module = importlib.import_module(f"pdserve.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def _registers(name: str) -> bool:
    """Whether command module `name` defines `register` (read from its source, not imported)."""
    spec = importlib.util.find_spec(f"pdserve.commands.{name}")
    source = spec.loader.get_source(spec.name) if spec is not None and spec.loader is not None else None
    return source is None or "\ndef register(" in source


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
