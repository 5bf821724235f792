"""OpenAI response bodies: whole responses and streaming chunks for completions and chat.

Contract: a `ResponseFormat` is made once per request (id, model, created time, whether choices
carry `token_ids`) and turns output pieces into JSON-ready dicts. Streams are, in order:
`opening()` chunks (chat: one chunk with the assistant role per choice), `delta()` chunks for
output text, one `closing()` chunk per choice with its finish_reason, and `usage_chunk()`
(choices []) when the client asked for `stream_options.include_usage`. Every choice carries its
`index` (n > 1) and `logprobs` (the object `logprobs_body` builds, or null).
`sse()` frames one event as `data: <json>\\n\\n`. `delta_event()` is `sse(delta(...))` byte for byte:
a text piece without logprobs is spliced into a per-choice template rendered once per request, so
a streamed token costs one string encode instead of a chunk dict and a whole JSON document.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pdserve.api.logprob_format import TokenNames, chat_logprobs, completion_logprobs

DONE_EVENT = b"data: [DONE]\n\n"
_TEXT_HOLE = "\ue000pdserve-text\ue000"  # stands for the text while a template is rendered
_IDS_HOLE = -987_654_321  # and for the token ids


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(',', ':'))


def sse(payload: dict) -> bytes:
    return f"data: {_json(payload)}\n\n".encode()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, those reused rather than computed (OpenAI's and vLLM's field)

    def as_dict(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class FullChoice:
    """One choice of a whole (non-streamed) response."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: dict | None = None


@dataclass(frozen=True)
class ResponseFormat:
    """Completion (`text_completion`) bodies; `ChatFormat` overrides the choice shapes."""

    request_id: str
    model: str
    return_token_ids: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _templates: dict = field(default_factory=dict, compare=False, repr=False)  # choice index -> delta_event's pieces

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    # ---- whole response ---------------------------------------------------------------------
    def response(self, choices: list[FullChoice], usage: Usage) -> dict:
        return {**self._header(self.object_name), "choices": [self._whole(c) for c in choices], "usage": usage.as_dict()}

    def _whole(self, c: FullChoice) -> dict:
        choice = {"index": c.index, **self._full_choice(c.text), "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        self._add_ids(choice, c.token_ids)
        return choice

    @staticmethod
    def logprobs_body(entries: list, names: TokenNames, offset: int) -> dict:
        """The choice's `logprobs` object for these entries (logprob_format.py)."""
        return completion_logprobs(entries, names, offset)

    def _full_choice(self, text: str) -> dict:
        return {"text": text}

    # ---- stream -----------------------------------------------------------------------------
    def opening(self, n: int = 1) -> list[dict]:
        return []

    def delta(self, text: str, token_ids: tuple[int, ...] | list[int], index: int = 0, logprobs: dict | None = None) -> dict:
        return self._chunk(self._delta_choice(text), None, token_ids, index, logprobs)

    def delta_event(self, text: str, token_ids: tuple[int, ...] | list[int], index: int = 0,
                    logprobs: dict | None = None) -> bytes:
        """`sse(self.delta(...))`, byte for byte; without logprobs and with text, from the choice's template."""
        if logprobs is not None or not text:  # chat's empty delta is `{}`: another shape
            return sse(self.delta(text, token_ids, index, logprobs))
        head, middle, tail = self._template(index)
        if middle is None:
            return f"{head}{_json(text)}{tail}".encode()
        return f"{head}{_json(text)}{middle}{_json(list(token_ids))}{tail}".encode()

    def _template(self, index: int) -> tuple[str, str | None, str]:
        """The SSE text of a delta chunk around its text (and token ids): (head, middle, tail)."""
        parts = self._templates.get(index)
        if parts is None:
            rendered = f"data: {_json(self.delta(_TEXT_HOLE, (_IDS_HOLE,), index))}\n\n"
            head, rest = rendered.split(_json(_TEXT_HOLE))
            middle, tail = rest.split(_json([_IDS_HOLE])) if self.return_token_ids else (None, rest)
            parts = self._templates[index] = (head, middle, tail)
        return parts

    def closing(self, text: str, finish_reason: str, index: int = 0) -> dict:
        return self._chunk(self._delta_choice(text), finish_reason, None, index)

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._header(self.chunk_object_name), "choices": [], "usage": usage.as_dict()}

    def _delta_choice(self, text: str) -> dict:
        return {"text": text}

    def _chunk(self, body: dict, finish_reason: str | None, token_ids, index: int = 0, logprobs: dict | None = None) -> dict:
        choice = {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            self._add_ids(choice, token_ids)
        elif self.return_token_ids:
            choice["token_ids"] = []
        chunk = {**self._header(self.chunk_object_name), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    # ---- shared -----------------------------------------------------------------------------
    def _header(self, object_name: str) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}

    def _add_ids(self, choice: dict, token_ids) -> None:
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)


@dataclass(frozen=True)
class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _full_choice(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def opening(self, n: int = 1) -> list[dict]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}}, None, [], i) for i in range(n)]

    @staticmethod
    def logprobs_body(entries: list, names: TokenNames, offset: int) -> dict:
        return chat_logprobs(entries, names)

    def _delta_choice(self, text: str) -> dict:
        return {"delta": {"content": text}} if text else {"delta": {}}
