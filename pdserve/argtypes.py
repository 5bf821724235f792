"""argparse `type=` functions shared by the commands: a value no run can use is refused at the
parse (`pdserve CMD: error: argument --FLAG: ...`, exit 2) instead of ending in a traceback, a
hang or a silently wrong report later. Standard library only: the parser is built for every
command (pdserve/cli.py), so nothing here may import numpy or torch.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

MAX_COUNT = 10**7  # requests or trace lines a run generates up front: 10**12 was a 7 TiB numpy array
MAX_TOKENS = 1 << 20  # a prompt or output length: the benchmark's length specs clip there


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def finite(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive(text: str) -> float:
    """A finite number > 0."""
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def nonnegative(text: str) -> float:
    """A finite number >= 0."""
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def rate(text: str) -> float:
    """Requests per second: > 0; 'inf' sends everything at once."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return value


def fraction(text: str) -> float:
    """An attainment or share in (0, 1]."""
    value = finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def share(text: str) -> float:
    """A fraction in [0, 1]."""
    value = finite(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when `high` is None)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text!r}")
        return value

    return parse


count = int_in(1, MAX_COUNT)
tokens = int_in(1, MAX_TOKENS)
positive_int = int_in(1)
nonnegative_int = int_in(0)


def rates(text: str) -> tuple[float, ...]:
    """A comma-separated ladder of rates, each finite and > 0."""
    values = tuple(positive(x) for x in text.split(",") if x.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}")
    return values


def output_file(text: str) -> str:
    """A path a result can be written to once the run is over: not a directory, and its folder
    exists (or can be made) and is writable; checked first so a finished run is not lost."""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file path")
    folder = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is not a writable directory")
    return text
