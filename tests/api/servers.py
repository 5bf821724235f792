"""Test helpers: a uvicorn server on a free local port in a thread, and a scripted fake Backend."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn

from pdserve.api.backend import (
    ErrorEvent, FinishEvent, GenerationEvent, GenerationRequest, Rejection, TokenEvent, WorkerView,
)


class ServerThread:
    """Serves `app` on 127.0.0.1:<free port> until `stop()`."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class ByteTokenizer:
    """Text -> its UTF-8 bytes (no BOS); enough for the fake backend."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(text.encode())


@dataclass
class FakeBackend:
    """A scripted Backend: per request, `first_delay_s`, then `events` (TokenEvents spaced by
    `gap_s`), then endless tokens when `endless`. Records submits and aborts."""

    model_name: str = "fake"
    max_model_len: int = 64
    events: list[GenerationEvent] = field(default_factory=list)
    reject: Rejection | None = None
    first_delay_s: float = 0.0
    gap_s: float = 0.01
    endless: bool = False
    raise_after: Exception | None = None  # raised by the iterator after `events`
    is_healthy: bool = True
    submitted: list[str] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    closed_iterators: list[str] = field(default_factory=list)

    def tokenizer(self):
        return ByteTokenizer()

    async def submit(self, request: GenerationRequest):
        if self.reject is not None:
            raise self.reject
        self.submitted.append(request.request_id)
        try:
            await asyncio.sleep(self.first_delay_s)
            for event in self.events:
                yield event
                await asyncio.sleep(self.gap_s)
            if self.raise_after is not None:
                raise self.raise_after
            while self.endless:
                yield TokenEvent((65,), "A")
                await asyncio.sleep(self.gap_s)
        finally:
            self.closed_iterators.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def healthy(self) -> bool:
        return self.is_healthy

    def workers(self) -> list[WorkerView]:
        return [WorkerView("w0", "colocated", "localhost", 1, 3, "serving", {"running": 0})]

    def metrics_text(self) -> bytes:
        return b"# HELP fake_up 1 when up\n# TYPE fake_up gauge\nfake_up 1.0\n"


def tokens(*texts: str) -> list[TokenEvent]:
    return [TokenEvent((i,), t) for i, t in enumerate(texts)]


def finish(reason: str = "stop", prompt_tokens: int = 3, completion_tokens: int = 2, text: str = "") -> FinishEvent:
    return FinishEvent(reason, prompt_tokens, completion_tokens, text)


def error(message: str = "worker died", code: str = "worker_lost") -> ErrorEvent:
    return ErrorEvent(message, code)
