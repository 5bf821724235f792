"""Parsing one line of an OpenAI-style server-sent-event stream.

Contract: `parse_sse_line` is pure. Lines that are not ``data:`` lines (blank separators, comments,
``event:``/``id:`` fields) give None. ``data: [DONE]`` gives a `done` event. A JSON chunk gives the
text it carries (completions ``choices[0].text`` or chat ``choices[0].delta.content``), the
``usage.completion_tokens`` when present, and an error message when the chunk is an error object.
Malformed JSON is reported as an error event, not raised. `sse_lines` splits a byte stream into
lines where SSE does (LF, CRLF or CR), never on the Unicode line breaks a token's text may hold.

`token` says whether a chunk stands for generated output, which is what TTFT and ITL time: any
chunk with text, and also a chunk whose text field is present but empty while it carries no
finish reason and no chat role. Servers send those for tokens whose text is held back (a partial
UTF-8 character, a special token); vLLM's own benchmark counts them too. A closing chunk with a
finish reason and no text, a chat opening (role) chunk and a usage-only chunk are not tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamEvent:
    """What one data line said."""

    done: bool = False
    text: str = ""
    token: bool = False  # the chunk stands for generated output (see the module contract)
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
    text, token = _choice_text(chunk.get("choices") or [])
    return StreamEvent(text=text, token=token, usage_tokens=tokens)


def _choice_text(choices: list) -> tuple[str, bool]:
    """(text, stands for a token) of the first choice."""
    if not choices or not isinstance(choices[0], dict):
        return "", False
    choice = choices[0]
    if "text" in choice:  # completions
        text, has_field = choice["text"] or "", True
    else:  # chat: the opening chunk carries the role, not a token
        delta = choice.get("delta") or {}
        text, has_field = delta.get("content") or "", "content" in delta and "role" not in delta
    return text, bool(text) or (has_field and choice.get("finish_reason") is None)


async def sse_lines(chunks):
    """Lines of an event stream split as SSE does (LF, CRLF or CR only): a generic line splitter
    would also break on U+2028 or U+0085, which a token's text may hold."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        held = b"\r" if buffer.endswith(b"\r") else b""  # may be the first half of CRLF
        *lines, rest = buffer[: len(buffer) - len(held)].replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        buffer = rest + held
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buffer.rstrip(b"\r"):
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")
