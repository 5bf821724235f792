"""Parsing one line of an OpenAI-style server-sent-event stream.

Contract: `parse_sse_line` is pure. Lines that are not ``data:`` lines (blank separators, comments,
``event:``/``id:`` fields) give None. ``data: [DONE]`` gives a `done` event. A JSON chunk gives the
text it carries (completions ``choices[0].text`` or chat ``choices[0].delta.content``), the
``usage.completion_tokens`` when present, and an error message when the chunk is an error object.
Malformed JSON is reported as an error event, not raised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamEvent:
    """What one data line said."""

    done: bool = False
    text: str = ""
    usage_tokens: int | None = None
    error: str = ""


DONE = StreamEvent(done=True)


def parse_sse_line(line: str) -> StreamEvent | None:
    """The event on one stream line, or None if the line carries no data."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    if not payload:
        return None
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        return StreamEvent(error="bad_json")
    if not isinstance(chunk, dict):
        return StreamEvent(error="bad_json")
    return _chunk_event(chunk)


def _chunk_event(chunk: dict) -> StreamEvent:
    if chunk.get("error") is not None or chunk.get("object") == "error":
        return StreamEvent(error="stream_error")
    usage = chunk.get("usage") or {}
    tokens = usage.get("completion_tokens")
    return StreamEvent(text=_choice_text(chunk.get("choices") or []), usage_tokens=tokens)


def _choice_text(choices: list) -> str:
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""
