"""`InProcessBackend`: the Backend protocol over one in-process Engine, driven by its own thread.

Threads: only the engine thread touches the Engine. The event loop talks to it through a FIFO of
typed commands (`_Submit`, `_Abort`, `_Call`, `_Stop`) that the engine thread drains between
steps (blocking while idle); events flow back to each request's asyncio queue through
`loop.call_soon_threadsafe`. So `submit`, `abort` and `run_on_engine` are safe from any thread.

Life cycle of a request:
    submit() -> [Rejection: closed, broken or over `max_pending`] -> _Submit queued
      -> engine thread: add_request (InvalidRequest -> ErrorEvent "invalid_request")
      -> each step: TokenEvent per new token -> FinishEvent when the engine finishes it
    abort() (or the consumer dropping the iterator early) -> _Abort -> engine.abort ->
      FinishEvent("abort"); unknown or already finished ids are ignored.
A step that raises fails every request in the engine with ErrorEvent("engine_error") and the
thread keeps serving; if the engine's pool integrity check then fails too, the backend turns
unhealthy and rejects new work with 503. `close()` fails in-flight requests with
ErrorEvent("shutdown") and joins the thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.backend import (
    ErrorEvent, FinishEvent, GenerationEvent, GenerationRequest, Rejection, TokenEvent, WorkerView,
)
from pdserve.api.metrics import RequestClock, ServingMetrics
from pdserve.engine.engine import Engine
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class _Sink:
    """One request's event queue, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()

    def push(self, event: GenerationEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    sink: _Sink
    clock: RequestClock


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: Future


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass
class _Live:
    """Engine-thread record of an admitted request."""

    sink: _Sink
    clock: RequestClock
    num_prompt_tokens: int
    num_output_tokens: int = 0

    def end(self, event: GenerationEvent, result: str) -> None:
        self.sink.push(event)
        self.clock.finish(result, self.num_output_tokens)


@dataclass(frozen=True)
class EngineLoad:
    """Snapshot the engine thread publishes after each turn (read by workers())."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0


@dataclass
class _Slots:
    """Requests submitted and not yet ended, counted on the event-loop side for `max_pending`."""

    limit: int | None
    num_open: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> None:
        with self.lock:
            if self.limit is not None and self.num_open >= self.limit:
                raise Rejection(f"{self.num_open} requests in flight (limit {self.limit})", 429, 1.0, "overloaded")
            self.num_open += 1

    def give(self) -> None:
        with self.lock:
            self.num_open -= 1


class InProcessBackend:
    """Serves one Engine in this process. Call `close()` when done."""

    def __init__(self, engine: Engine, model_name: str, *, max_pending: int | None = None,
                 metrics: ServingMetrics | None = None):
        self.engine = engine  # owned by the engine thread from now on
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self._tokenizer = engine.tokenizer
        self.metrics = metrics or ServingMetrics()
        self.load = EngineLoad(num_free_blocks=engine.blocks.num_free)
        self._slots = _Slots(max_pending)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._closed = False
        self._broken: str | None = None
        self._put_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"pdserve-engine-{model_name}", daemon=True)
        self._thread.start()

    # ---- Backend protocol (any thread / the event loop) ---------------------------------------
    def tokenizer(self):
        return self._tokenizer

    async def submit(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Events of one request; leaving the iteration early aborts the request."""
        command = self._enqueue(request)
        ended = False
        try:
            while not ended:
                event = await command.sink.queue.get()
                ended = not isinstance(event, TokenEvent)
                yield event
        finally:
            self._slots.give()
            if not ended:
                self._put(_Abort(request.request_id), quiet=True)

    async def abort(self, request_id: str) -> None:
        self._put(_Abort(request_id), quiet=True)

    def healthy(self) -> bool:
        return not self._closed and self._broken is None and self._thread.is_alive()

    def workers(self) -> list[WorkerView]:
        load = self.load
        state = "serving" if self.healthy() else "broken" if self._broken else "stopped"
        counts = {"running": load.num_running, "waiting": load.num_waiting, "free_blocks": load.num_free_blocks}
        return [WorkerView("inproc-0", "colocated", socket.gethostname(), os.getpid(), 0, state, counts, self.engine.numerics)]

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    # ---- extras ---------------------------------------------------------------------------
    def run_on_engine(self, fn: Callable[[Engine], Any]) -> Future:
        """Run `fn(engine)` on the engine thread between steps; its result or error lands in the Future."""
        future: Future = Future()
        self._put(_Call(fn, future))
        return future

    def close(self, timeout_s: float = 30.0) -> None:
        """Fail in-flight requests with ErrorEvent("shutdown") and stop the engine thread."""
        with self._put_lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(_Stop())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.1f s", timeout_s)

    def _enqueue(self, request: GenerationRequest) -> _Submit:
        """Admission control, then hand the request to the engine thread (raises `Rejection`)."""
        try:
            self._check_admissible()
            self._slots.take()
        except Rejection:
            self.metrics.count_rejected()
            raise
        command = _Submit(request, _Sink(asyncio.get_running_loop()), self.metrics.clock())
        try:
            self._put(command)
        except Rejection:
            self._slots.give()
            command.clock.finish("rejected", 0)
            raise
        return command

    def _check_admissible(self) -> None:
        if self._broken is not None:
            raise Rejection(f"the engine is broken: {self._broken}", 503, 30.0, "engine_broken")
        if self._closed:
            raise Rejection("the backend is shut down", 503, 1.0, "shutdown")

    def _put(self, command: Any, quiet: bool = False) -> None:
        with self._put_lock:
            if not self._closed:
                self._commands.put(command)
                return
        if not quiet:
            raise Rejection("the backend is shut down", 503, 1.0, "shutdown")

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                self._publish_load()
        except BaseException:
            log.exception("engine thread crashed")
            self._broken = "engine thread crashed"
        finally:
            self._shutdown()

    def _drain(self, block: bool) -> bool:
        """Handle queued commands (waiting for one when `block`); False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while not isinstance(command, _Stop):
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _handle(self, command: _Submit | _Abort | _Call) -> None:
        if isinstance(command, _Submit):
            self._admit(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)
        else:
            self._call(command)

    def _admit(self, command: _Submit) -> None:
        request = command.request
        live = _Live(command.sink, command.clock, len(request.prompt_ids))
        try:
            self.engine.add_request(request.request_id, list(request.prompt_ids), request.params)
        except Exception as exc:
            code = "invalid_request" if isinstance(exc, InvalidRequest) else "engine_error"
            live.end(ErrorEvent(str(exc), code), "error")
            return
        self._live[request.request_id] = live

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:  # already finished, failed, or never admitted
            return
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)
        live.end(FinishEvent("abort", live.num_prompt_tokens, live.num_output_tokens), "abort")

    def _call(self, command: _Call) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            command.future.set_result(command.fn(self.engine))
        except BaseException as exc:
            command.future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._check_engine()  # first: a caller woken by the error must already see the health verdict
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}", "engine_error")
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        live.num_output_tokens = len(output.output_ids)
        if output.new_token_ids or output.new_text:
            live.clock.first_tokens()
            live.sink.push(TokenEvent(tuple(output.new_token_ids), output.new_text, output.index, output.finish_reason,
                                      output.logprobs, output.prompt_logprobs))
        if output.finished:
            del self._live[output.request_id]
            reason = output.finish_reason or "stop"
            live.end(FinishEvent(reason, output.num_prompt_tokens, live.num_output_tokens,
                                 cached_tokens=output.num_cached_tokens), reason)

    def _fail_all(self, message: str, code: str) -> None:
        """End every admitted request with an ErrorEvent and take it out of the engine."""
        for request_id, live in list(self._live.items()):
            del self._live[request_id]
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("engine.abort(%s) failed", request_id)
            live.end(ErrorEvent(message, code), "error")

    def _check_engine(self) -> None:
        try:
            self.engine.check_integrity()
        except Exception as exc:
            self._broken = f"pool integrity check failed: {exc}"
            log.error("engine marked broken: %s", self._broken)

    def _publish_load(self) -> None:
        sched = self.engine.scheduler
        self.load = EngineLoad(len(sched.running), len(sched.waiting), self.engine.blocks.num_free)

    def _shutdown(self) -> None:
        """Engine thread's last act: fail whatever is admitted or still queued."""
        with self._put_lock:
            self._closed = True  # nothing can be queued after this
        self._fail_all("the backend was shut down", "shutdown")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Submit):
                command.clock.finish("error", 0)
                command.sink.push(ErrorEvent("the backend was shut down", "shutdown"))
            elif isinstance(command, _Call):
                command.future.set_exception(RuntimeError("the backend was shut down"))
