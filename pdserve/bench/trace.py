"""Reading a JSON-lines workload trace.

One JSON object per line:

- ``prompt`` (text, sent verbatim) or ``prompt_len`` (alias ``input_len``: tokens to synthesise);
- ``output_len`` (alias ``output_tokens``): tokens to request;
- ``arrival_s`` (alias ``timestamp``), optional: seconds on any common clock.

Blank lines and lines starting with ``#`` are skipped. Arrival times are used only if every entry
has one; otherwise the configured arrival process schedules the trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceEntry:
    """One trace line: exactly one of `prompt` and `prompt_len` is set."""

    output_len: int
    prompt: str | None = None
    prompt_len: int | None = None
    arrival_s: float | None = None


def read_trace(path: str | Path) -> list[TraceEntry]:
    """All entries of a JSON-lines trace, in file order. Raises ValueError naming the bad line."""
    entries = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            entries.append(parse_entry(json.loads(line)))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}:{line_no}: {exc}") from exc
    if not entries:
        raise ValueError(f"{path}: trace has no entries")
    return entries


def parse_entry(obj: dict) -> TraceEntry:
    """One decoded JSON object as a TraceEntry."""
    prompt = obj.get("prompt")
    prompt_len = _first(obj, "prompt_len", "input_len")
    if (prompt is None) == (prompt_len is None):
        raise ValueError("need exactly one of 'prompt' and 'prompt_len'")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string")
    output_len = _first(obj, "output_len", "output_tokens")
    if output_len is None or int(output_len) < 1:
        raise ValueError("need 'output_len' >= 1")
    arrival = _first(obj, "arrival_s", "timestamp")
    return TraceEntry(
        output_len=int(output_len),
        prompt=prompt,
        prompt_len=None if prompt_len is None else max(1, int(prompt_len)),
        arrival_s=None if arrival is None else float(arrival),
    )


def _first(obj: dict, *keys: str):
    for key in keys:
        if obj.get(key) is not None:
            return obj[key]
    return None
