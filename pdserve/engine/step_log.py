"""Engine step log: one JSON line per engine step, with the step's shape and its wall time.

Contract: `StepRecord` is the whole schema: `end` (wall clock, `time.time()`, when the step
returned), `seconds` (the step's duration: schedule + forward + sampling, as `pdserve profile`
times it), the prompt rows it prefilled (`new`, one entry per prefilling request) with the
tokens those requests already had in K/V (`cached`), and the decode rows (`batch`) with their
visible context summed (`context`). `StepLog` appends records to a file and flushes each line,
so a reader in another process sees every finished step. `read_steps` returns the records of
a log whose `end` lies in [start, stop].

Why: a served engine's speed on a shared machine drifts within minutes. The planner's validation
(`pdserve plan --validate`) compares these records with its latency model to learn how fast the
engine ran *during* each benchmark window, measured by the runtime itself (sim/step_clock.py).
`pdserve serve --trace-dir DIR` writes one log per worker, DIR/<worker>.steps.jsonl.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec


class StepRecord(msgspec.Struct, frozen=True):
    end: float  # time.time() when the step returned
    seconds: float
    new: tuple[int, ...] = ()  # prompt rows prefilled this step, per request
    cached: tuple[int, ...] = ()  # tokens each of those requests had in K/V before the step
    batch: int = 0  # decode rows
    context: int = 0  # visible tokens summed over the decode rows

    @property
    def kind(self) -> str:
        if self.new and self.batch:
            return "mixed"
        return "prefill" if self.new else "decode"


class StepLog:
    """Appends `StepRecord`s to `path`, one flushed JSON line each (thread-safe)."""

    def __init__(self, path: str | Path):
        self._file = open(path, "ab")
        self._encoder = msgspec.json.Encoder()
        self._lock = threading.Lock()

    def record(self, record: StepRecord) -> None:
        line = self._encoder.encode(record) + b"\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def step_record(started: float, new: Iterable[int], cached: Iterable[int], batch: int, context: int) -> StepRecord:
    """A record for a step that began at `started` (time.perf_counter()) and ends now."""
    seconds = time.perf_counter() - started
    return StepRecord(time.time(), seconds, tuple(new), tuple(cached), batch, context)


_decoder = msgspec.json.Decoder(StepRecord)


def read_steps(paths: Iterable[str | Path], start: float = float("-inf"), stop: float = float("inf")) -> list[StepRecord]:
    """Every record of the logs at `paths` that ended within [start, stop], in end order. A torn
    last line (a writer mid-flush) is skipped; any other malformed line raises ValueError."""
    out = []
    for path in paths:
        lines = Path(path).read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = _decoder.decode(line)
            except msgspec.DecodeError as exc:
                if i == len(lines) - 1:  # no newline yet: being written
                    continue
                raise ValueError(f"{path}:{i + 1}: not a step record: {exc}") from exc
            if start <= record.end <= stop:
                out.append(record)
    return sorted(out, key=lambda r: r.end)
