"""OpenAI response bodies: whole responses and streaming chunks for completions and chat.

Contract: a `ResponseFormat` is made once per request (id, model, created time, whether choices
carry `token_ids`) and turns output pieces into JSON-ready dicts. Streams are, in order:
`opening()` chunks (chat: one chunk with the assistant role), `delta()` chunks for output text,
one `closing()` chunk with the finish_reason, and `usage_chunk()` (choices []) when the client
asked for `stream_options.include_usage`. `sse()` frames one event as `data: <json>\\n\\n`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

DONE_EVENT = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


@dataclass(frozen=True)
class ResponseFormat:
    """Completion (`text_completion`) bodies; `ChatFormat` overrides the choice shapes."""

    request_id: str
    model: str
    return_token_ids: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    # ---- whole response ---------------------------------------------------------------------
    def response(self, text: str, token_ids: list[int], finish_reason: str, usage: Usage) -> dict:
        choice = {"index": 0, **self._full_choice(text), "logprobs": None, "finish_reason": finish_reason}
        self._add_ids(choice, token_ids)
        return {**self._header(self.object_name), "choices": [choice], "usage": usage.as_dict()}

    def _full_choice(self, text: str) -> dict:
        return {"text": text}

    # ---- stream -----------------------------------------------------------------------------
    def opening(self) -> list[dict]:
        return []

    def delta(self, text: str, token_ids: tuple[int, ...] | list[int]) -> dict:
        return self._chunk(self._delta_choice(text), None, token_ids)

    def closing(self, text: str, finish_reason: str) -> dict:
        return self._chunk(self._delta_choice(text), finish_reason, None)

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._header(self.chunk_object_name), "choices": [], "usage": usage.as_dict()}

    def _delta_choice(self, text: str) -> dict:
        return {"text": text}

    def _chunk(self, body: dict, finish_reason: str | None, token_ids) -> dict:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}
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

    def opening(self) -> list[dict]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}}, None, [])]

    def _delta_choice(self, text: str) -> dict:
        return {"delta": {"content": text}} if text else {"delta": {}}
