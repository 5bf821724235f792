"""The contract between the HTTP layer and whatever serves requests behind it.

The API layer parses and validates OpenAI-style requests, turns them into a `GenerationRequest`
(token ids + sampling parameters), and consumes the backend's `GenerationEvent` stream:

    submit(request) -> async iterator of events:
        zero or more TokenEvent (token ids + text released by them, in order)
        exactly one terminal event: FinishEvent (finish_reason, usage) or ErrorEvent
    abort(request_id)  -> cancel in every phase; blocks and transfers are freed

A `Rejection` raised by `submit` before any event means the request was not admitted
(early rejection: no prefill work was spent); the API answers 429/503 with Retry-After.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.sequence import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = "default"


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    text: str
    index: int = 0  # which of an n > 1 request's sequences
    finish_reason: str | None = None  # set when this sequence ended with these tokens (the request may go on)
    logprobs: tuple = ()  # engine.logprobs.TokenLogprobs per token, when asked for
    prompt_logprobs: tuple | None = None  # prompt positions 1.., once, when asked for


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # any text released only at the finish (held back for stop strings)
    cached_tokens: int = 0  # prompt tokens reused, not computed (usage.prompt_tokens_details.cached_tokens)


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    code: str = "internal_error"  # e.g. "kv_not_visible", "worker_lost"


GenerationEvent = TokenEvent | FinishEvent | ErrorEvent


class Rejection(Exception):
    """Not admitted. `status` is 429 (over the limit) or 503 (no feasible route)."""

    def __init__(self, message: str, status: int = 503, retry_after_s: float = 1.0, reason: str = "overloaded"):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(frozen=True)
class WorkerView:
    """One row of GET /workers."""

    id: str
    role: str
    host: str
    pid: int
    epoch: int
    state: str
    load: dict[str, int] = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)  # kind, features, math paths, product plan (model/cpu.py)
    tp: int = 1  # tensor-parallel ranks of the worker (workers/process/tp_rank.py)


class Backend(Protocol):
    model_name: str
    max_model_len: int

    def tokenizer(self):  # pdserve.model.tokenizer.Tokenizer | None
        ...

    def submit(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        ...

    async def abort(self, request_id: str) -> None:
        ...

    def healthy(self) -> bool:
        """True only when at least one complete route (prefill + decode, or colocated) exists."""
        ...

    def workers(self) -> list[WorkerView]:
        ...

    def metrics_text(self) -> bytes:
        """Prometheus exposition text."""
        ...
