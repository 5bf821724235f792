"""Handoff trace: one JSON object per line for every transaction event.

Contract: every event carries request, transfer and generation (plus attempt), so a trace
analyzer can rebuild each transaction's timeline. One clock per sink (`time.monotonic` by
default). The schema is fixed by `TraceEvent`; `EVENTS` (the ledger's) lists the allowed event
names; `quiesced` marks an aborted destination whose last in-flight write ended, so its blocks
went back.
A sink writes to a file, keeps events in memory, or both; `NullSink` drops everything.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, IO

import msgspec

from pdserve.ledger.trace import EVENTS  # one list of event names for writers and readers


class TraceEvent(msgspec.Struct, frozen=True, omit_defaults=False):
    ts: float
    event: str
    request: str
    transfer: str
    generation: int
    attempt: int
    layer: int | None = None
    chunk: str | None = None
    bytes: int | None = None
    reason: str | None = None
    worker: str | None = None
    tokens: int | None = None  # layer_ready: prompt tokens final so far (None: the whole layer); chunk_send: the chunk's token end


class TraceSink:
    def __init__(self, path: str | None = None, keep: bool = True, clock: Callable[[], float] = time.monotonic):
        self._file: IO[bytes] | None = open(path, "ab") if path else None
        self._keep = keep
        self.events: list[TraceEvent] = []
        self.clock = clock
        self._encoder = msgspec.json.Encoder()
        self._lock = threading.Lock()

    def emit(self, event: str, request: str, transfer: str, generation: int, attempt: int, ts: float | None = None,
             **fields) -> TraceEvent:
        """`ts` (this sink's clock) when the event happened earlier than now, e.g. a send's start."""
        if event not in EVENTS:
            raise ValueError(f"unknown trace event {event!r}")
        record = TraceEvent(self.clock() if ts is None else ts, event, request, transfer, generation, attempt, **fields)
        with self._lock:
            if self._keep:
                self.events.append(record)
            if self._file is not None:
                self._file.write(self._encoder.encode(record) + b"\n")
        return record

    def of(self, event: str) -> list[TraceEvent]:
        return [e for e in self.events if e.event == event]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class NullSink(TraceSink):
    def __init__(self) -> None:
        super().__init__(keep=False)


def read_trace(path: str) -> list[TraceEvent]:
    decoder = msgspec.json.Decoder(TraceEvent)
    with open(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]
