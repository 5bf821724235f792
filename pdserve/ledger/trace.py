"""Transfer-trace contract over the runtime's JSON-lines traces.

One line per event: {"ts", "event", "request", "transfer", "generation", "attempt", "layer",
"chunk", "bytes", "reason", "worker", "tokens"} (ts in seconds; "tokens" optional). Events are grouped into transactions by
`transfer`; request-level events written without a transfer id (prefill_start, decode_ready,
...) join every transaction of the same request and generation.

A transaction is rejected (status "invalid") unless: all its events carry one request and one
generation; it publishes at most once; and, when it publishes, a validate event and a
chunk_visible event for every expected layer precede the publication, no chunk was sent before
its layer was ready (or, with a `tokens` watermark on layer_ready, before its tokens were), no ack precedes publication, and no abort accompanies it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence

from pdserve.ledger.transfer import exposed_stall_s, overlapped_work_s, union_length_s

EVENTS = frozenset(
    "reserve chunk_send chunk_receive chunk_visible validate publish ack abort retry "
    "layer_ready prefill_start prefill_end decode_ready reject quiesced".split()
)
REQUIRED_KEYS = ("ts", "event", "request", "transfer", "generation", "attempt")


class TraceFormatError(ValueError):
    """A trace line does not follow the event schema."""


@dataclass(frozen=True)
class TraceEvent:
    ts_s: float
    event: str
    request: str
    transfer: str | None
    generation: int
    attempt: int
    layer: int | None = None
    chunk: str | None = None
    nbytes: int | None = None
    reason: str | None = None
    worker: str | None = None
    tokens: int | None = None  # layer_ready: prompt tokens final so far (None: whole layer); chunk_send: chunk's token end


def parse_event(record: dict, line_no: int = 0) -> TraceEvent:
    """Validate one decoded line; raises TraceFormatError naming the line and the field."""
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise TraceFormatError(f"line {line_no}: missing keys {missing}")
    if record["event"] not in EVENTS:
        raise TraceFormatError(f"line {line_no}: unknown event {record['event']!r}")
    try:
        return TraceEvent(
            ts_s=float(record["ts"]),
            event=record["event"],
            request=str(record["request"]),
            transfer=None if record["transfer"] is None else str(record["transfer"]),
            generation=int(record["generation"]),
            attempt=int(record["attempt"]),
            layer=None if record.get("layer") is None else int(record["layer"]),
            chunk=record.get("chunk"),
            nbytes=None if record.get("bytes") is None else int(record["bytes"]),
            reason=record.get("reason"),
            worker=record.get("worker"),
            tokens=None if record.get("tokens") is None else int(record["tokens"]),
        )
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"line {line_no}: {exc}") from exc


def parse_jsonl(lines: Iterable[str]) -> list[TraceEvent]:
    """Parse JSON lines, skipping blank ones."""
    events = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"line {number}: not JSON ({exc.msg})") from exc
            events.append(parse_event(record, number))
    return events


@dataclass(frozen=True)
class TransactionReport:
    transfer: str
    request: str
    generation: int
    status: str  # published | aborted | rejected | incomplete | invalid
    reason: str
    wall_s: float
    overlapped_s: float
    busy_s: float
    retries: int
    exposed_stall_s: float | None
    logical_bytes: int
    sent_bytes: int
    layers_visible: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.status != "invalid"


def group_transactions(events: Sequence[TraceEvent]) -> dict[str, list[TraceEvent]]:
    """transfer id -> its events plus matching request-level events, in time order."""
    groups: dict[str, list[TraceEvent]] = {}
    for ev in events:
        if ev.transfer is not None:
            groups.setdefault(ev.transfer, []).append(ev)
    for transfer, group in groups.items():
        keys = {(ev.request, ev.generation) for ev in group}
        group.extend(ev for ev in events if ev.transfer is None and (ev.request, ev.generation) in keys)
        group.sort(key=lambda ev: ev.ts_s)
    return groups


def _first(events: Sequence[TraceEvent], name: str) -> TraceEvent | None:
    return next((ev for ev in events if ev.event == name), None)


def work_spans(events: Sequence[TraceEvent]) -> list[tuple[float, float]]:
    """Prefill [start, end] plus one [send, visible-or-failure] span per chunk attempt."""
    spans = []
    start, end = _first(events, "prefill_start"), _first(events, "prefill_end")
    if start and end:
        spans.append((start.ts_s, end.ts_s))
    for send in (ev for ev in events if ev.event == "chunk_send"):
        finish = next(
            (ev for ev in events if ev.event == "chunk_visible" and ev.chunk == send.chunk and ev.attempt == send.attempt),
            None,
        ) or next(
            (ev for ev in events if ev.event in ("retry", "abort") and ev.chunk in (send.chunk, None) and ev.ts_s >= send.ts_s),
            None,
        )
        if finish is not None:
            spans.append((send.ts_s, finish.ts_s))
    return spans


def expected_layers_of(events: Sequence[TraceEvent]) -> set[int]:
    """Layers announced by layer_ready, else the layers anything was sent for."""
    ready = {ev.layer for ev in events if ev.event == "layer_ready" and ev.layer is not None}
    return ready or {ev.layer for ev in events if ev.event == "chunk_send" and ev.layer is not None}


def contract_violation(events: Sequence[TraceEvent], expected_layers: set[int] | None) -> str | None:
    """The first broken rule of the transfer-trace contract, or None."""
    if len({ev.request for ev in events}) != 1 or len({ev.generation for ev in events}) != 1:
        pairs = sorted({(ev.request, ev.generation) for ev in events})
        return f"transaction mixes identities {pairs}"
    publishes = [ev for ev in events if ev.event == "publish"]
    if len(publishes) > 1:
        return f"published {len(publishes)} times"
    for ev in events:
        if ev.event == "chunk_send" and _sent_early(ev, events):
            return f"chunk {ev.chunk} sent at {ev.ts_s:.9g}s before layer {ev.layer} was ready"
    if not publishes:
        return None
    return _publication_violation(events, publishes[0].ts_s, expected_layers)


def _sent_early(send: TraceEvent, events: Sequence[TraceEvent]) -> bool:
    """Was `send` earlier than the first layer_ready covering it? A layer_ready without `tokens`
    covers the whole layer; one with `tokens` covers chunks ending there or earlier (chunked
    prefill streams a layer's early chunks). A layer never announced is not judged here."""
    marks = [ev for ev in events if ev.event == "layer_ready" and ev.layer == send.layer]
    covering = [ev.ts_s for ev in marks if ev.tokens is None or (send.tokens is not None and send.tokens <= ev.tokens)]
    if not marks:
        return False
    return not covering or send.ts_s < min(covering)


def _publication_violation(events: Sequence[TraceEvent], publish_s: float, expected: set[int] | None) -> str | None:
    layers = expected if expected is not None else expected_layers_of(events)
    if not layers:
        return "published without any expected layer"
    if any(ev.event == "abort" for ev in events):
        return "an aborted transaction was published"
    visible = {ev.layer for ev in events if ev.event == "chunk_visible" and ev.ts_s <= publish_s}
    missing = sorted(layers - visible)
    if missing:
        return f"layers {missing} not visible before publication"
    if not any(ev.event == "validate" and ev.ts_s <= publish_s for ev in events):
        return "published without a prior validate event"
    if any(ev.event == "ack" and ev.ts_s < publish_s for ev in events):
        return "source acknowledged before publication"
    return None


def _status(events: Sequence[TraceEvent], violation: str | None) -> tuple[str, str]:
    if violation is not None:
        return "invalid", violation
    for name, status in (("publish", "published"), ("abort", "aborted"), ("reject", "rejected")):
        found = _first(events, name)
        if found is not None:
            return status, found.reason or status
    return "incomplete", "no publish, abort or reject event"


def analyze_transaction(transfer: str, events: Sequence[TraceEvent], expected_layers: set[int] | None = None) -> TransactionReport:
    """Apply the contract to one transaction's events (time-ordered) and measure it."""
    status, reason = _status(events, contract_violation(events, expected_layers))
    spans = work_spans(events)
    publish, ready = _first(events, "publish"), _first(events, "decode_ready")
    visible = {}
    for ev in events:
        if ev.event == "chunk_visible":
            visible[ev.chunk] = ev
    return TransactionReport(
        transfer=transfer,
        request=events[0].request,
        generation=events[0].generation,
        status=status,
        reason=reason,
        wall_s=events[-1].ts_s - events[0].ts_s,
        overlapped_s=overlapped_work_s(spans),
        busy_s=union_length_s(spans),
        retries=sum(1 for ev in events if ev.event == "retry"),
        exposed_stall_s=exposed_stall_s(publish.ts_s, ready.ts_s) if publish and ready else None,
        logical_bytes=sum(ev.nbytes or 0 for ev in visible.values()),
        sent_bytes=sum(ev.nbytes or 0 for ev in events if ev.event == "chunk_send"),
        layers_visible=tuple(sorted({ev.layer for ev in visible.values() if ev.layer is not None})),
    )


def analyze_trace(events: Sequence[TraceEvent], expected_layers: set[int] | None = None) -> list[TransactionReport]:
    """One report per transfer id, in order of first appearance."""
    return [analyze_transaction(t, evs, expected_layers) for t, evs in group_transactions(events).items()]
