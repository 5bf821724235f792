"""The transfer-trace analyzer on the spec-style fixture and on a runtime-style JSONL trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.ledger.checks import load_fixture
from pdserve.ledger.trace import TraceFormatError, analyze_trace, parse_jsonl

KEYS = ("ts", "event", "request", "transfer", "generation", "attempt", "layer", "chunk", "bytes", "reason", "worker")


def line(ts, event, request, transfer, generation, attempt=0, layer=None, chunk=None, nbytes=None, reason=None, worker=None):
    return json.dumps(dict(zip(KEYS, (ts, event, request, transfer, generation, attempt, layer, chunk, nbytes, reason, worker))))


def published_run(request: str, transfer: str, generation: int, t0: float, layers: int = 4) -> list[str]:
    """A 1P1D request as the runtime writes it: request-level events carry no transfer id."""
    out = [line(t0, "reserve", request, transfer, generation, worker="D0"), line(t0, "prefill_start", request, None, generation, worker="P0")]
    for layer in range(layers):
        ready = t0 + 0.002 * (layer + 1)
        out.append(line(ready, "layer_ready", request, None, generation, layer=layer, worker="P0"))
        for c in range(2):
            chunk = f"{transfer}/L{layer}.{c}"
            out.append(line(ready + 0.0001 * c, "chunk_send", request, transfer, generation, layer=layer, chunk=chunk, nbytes=4096, worker="P0"))
            out.append(line(ready + 0.0005 + 0.0001 * c, "chunk_receive", request, transfer, generation, layer=layer, chunk=chunk, nbytes=4096, worker="D0"))
            out.append(line(ready + 0.0007 + 0.0001 * c, "chunk_visible", request, transfer, generation, layer=layer, chunk=chunk, nbytes=4096, worker="D0"))
    end = t0 + 0.002 * layers
    out += [
        line(end, "prefill_end", request, None, generation, worker="P0"),
        line(end + 0.0003, "decode_ready", request, None, generation, worker="D0"),
        line(end + 0.0009, "validate", request, transfer, generation, worker="D0"),
        line(end + 0.0010, "publish", request, transfer, generation, worker="D0"),
        line(end + 0.0011, "ack", request, transfer, generation, worker="P0"),
    ]
    return out


def runtime_trace() -> list[str]:
    lines = published_run("req-a", "xa", 1, 0.0)
    aborted = [
        line(0.001, "reserve", "req-b", "xb1", 1, worker="D1"),
        line(0.003, "chunk_send", "req-b", "xb1", 1, layer=0, chunk="xb1/L0.0", nbytes=4096, worker="P0"),
        line(0.004, "abort", "req-b", "xb1", 1, reason="decode worker epoch advanced", worker="D1"),
    ]
    rerouted = published_run("req-b", "xb2", 2, 0.005)
    rejected = [line(0.006, "reject", "req-c", "xc", 1, reason="no decode capacity", worker="router")]
    merged = lines + aborted + rerouted + rejected
    return sorted(merged, key=lambda text: json.loads(text)["ts"])


def test_spec_fixture_trace():
    fixture = load_fixture("transfer-trace")
    events = parse_jsonl(json.dumps(e) for e in fixture["events"])
    (report,) = analyze_trace(events, {0, 1})
    assert report.status == "published" and report.retries == 1
    assert round(report.wall_s * 1e6, 3) == 220
    assert round(report.overlapped_s * 1e6, 3) == 74
    assert round(report.exposed_stall_s * 1e6, 3) == 60
    assert report.logical_bytes == 8 << 20 and report.sent_bytes == 12 << 20


def test_runtime_style_trace(tmp_path: Path):
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(runtime_trace()) + "\n")
    with path.open() as handle:
        reports = {r.transfer: r for r in analyze_trace(parse_jsonl(handle))}
    assert {t: r.status for t, r in reports.items()} == {"xa": "published", "xb1": "aborted", "xb2": "published", "xc": "rejected"}
    a = reports["xa"]
    assert a.layers_visible == (0, 1, 2, 3) and a.logical_bytes == 8 * 4096
    assert a.exposed_stall_s == pytest.approx(0.0007)
    assert a.overlapped_s > 0 and a.wall_s == pytest.approx(0.0091)
    assert reports["xb1"].reason == "decode worker epoch advanced"
    assert reports["xb2"].generation == 2 and reports["xb2"].ok


def test_request_level_events_of_other_generations_are_not_attached():
    text = published_run("req-a", "xa", 2, 0.0, layers=1) + [line(0.0, "decode_ready", "req-a", None, 1)]
    (report,) = analyze_trace(parse_jsonl(text))
    assert report.ok and report.exposed_stall_s == pytest.approx(0.0007)  # not 0.003 from generation 1


def test_missing_layer_is_rejected():
    text = [t for t in published_run("req-a", "xa", 1, 0.0, layers=2) if not ('"chunk_visible"' in t and '"layer": 1' in t)]
    (report,) = analyze_trace(parse_jsonl(text))
    assert report.status == "invalid" and "layers [1] not visible" in report.reason


def test_format_errors_name_the_line():
    with pytest.raises(TraceFormatError, match="line 2"):
        parse_jsonl([line(0, "reserve", "r", "x", 1), "{not json"])
    with pytest.raises(TraceFormatError, match="missing keys"):
        parse_jsonl(['{"ts": 0, "event": "reserve"}'])


def _with_tokens(text: list[str], event: str, layer: int, tokens: int, ts: float | None = None) -> list[str]:
    """Add a `tokens` watermark (and optionally a timestamp) to the first `event` line of `layer`."""
    out, done = [], False
    for t in text:
        record = json.loads(t)
        if not done and record["event"] == event and record["layer"] == layer:
            record["tokens"], done = tokens, True
            if ts is not None:
                record["ts"] = ts
        out.append(json.dumps(record))
    return out


def test_watermarked_layer_ready_covers_only_chunks_ending_within_it():
    """Chunked prefill: an early layer_ready with a token watermark lets chunks up to it stream
    before the layer completes; a chunk past the watermark sent before completion is a violation."""
    base = published_run("req-a", "xa", 1, 0.0, layers=2)
    early = [line(0.0005, "layer_ready", "req-a", None, 1, layer=0, worker="P0")]
    early = _with_tokens(early, "layer_ready", 0, 512)
    within = _with_tokens(base, "chunk_send", 0, 512, ts=0.0008)  # before the layer completes at 0.002
    (report,) = analyze_trace(parse_jsonl(early + within))
    assert report.ok, report.reason
    beyond = _with_tokens(base, "chunk_send", 0, 1024, ts=0.0008)
    (report,) = analyze_trace(parse_jsonl(early + beyond))
    assert report.status == "invalid" and "before layer 0 was ready" in report.reason
    untagged = _with_tokens(base, "chunk_visible", 0, 0)  # a send without tokens needs the whole layer
    untagged = [t.replace('"ts": 0.002, "event": "chunk_send"', '"ts": 0.0008, "event": "chunk_send"') for t in untagged]
    (report,) = analyze_trace(parse_jsonl(early + untagged))
    assert report.status == "invalid"
