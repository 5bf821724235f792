"""SSE line parsing and stream timing, without a network."""

from __future__ import annotations

from pdserve.bench.http.client import StreamTimer, request_body, EndpointConfig
from pdserve.bench.http.sse import parse_sse_line
from pdserve.bench.workload import WorkloadConfig, build_workload


def test_parse_lines():
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: [DONE]").done
    assert parse_sse_line('data: {"choices":[{"text":"ab"}]}').text == "ab"
    assert parse_sse_line('data: {"choices":[{"delta":{"content":"x"}}]}').text == "x"
    assert parse_sse_line('data: {"choices":[{"delta":{"role":"assistant"}}]}').text == ""
    assert parse_sse_line('data: {"choices":[],"usage":{"completion_tokens":7}}').usage_tokens == 7
    assert parse_sse_line('data: {"error":{"message":"boom"}}').error == "stream_error"
    assert parse_sse_line("data: {not json").error == "bad_json"


def test_which_chunks_are_tokens():
    """A token chunk is one with text, or an empty text field without a finish reason (a token
    whose text is held back); closing, chat opening and usage-only chunks are not."""
    token = lambda line: parse_sse_line("data: " + line).token  # noqa: E731
    assert token('{"choices":[{"text":"ab","finish_reason":null}]}')
    assert token('{"choices":[{"text":"","finish_reason":null}]}')
    assert token('{"choices":[{"text":"z","finish_reason":"length"}]}')
    assert not token('{"choices":[{"text":"","finish_reason":"length"}]}')
    assert token('{"choices":[{"delta":{"content":""},"finish_reason":null}]}')
    assert token('{"choices":[{"delta":{"content":"x"}}]}')
    assert not token('{"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}')
    assert not token('{"choices":[{"delta":{},"finish_reason":"stop"}]}')
    assert not token('{"choices":[],"usage":{"completion_tokens":7}}')
    assert not token('{"choices":["junk"]}')


def test_timer_builds_records():
    request = build_workload(WorkloadConfig(num_requests=1)).requests[0]
    timer = StreamTimer(10.0)
    for t, line in ((10.1, 'data: {"choices":[{"text":"a"}]}'), (10.15, 'data: {"choices":[{"text":"b"}]}'),
                    (10.3, 'data: {"choices":[{"text":"c"}]}'), (10.3, 'data: {"choices":[],"usage":{"completion_tokens":4}}'),
                    (10.31, "data: [DONE]")):
        timer.add(parse_sse_line(line), t)
    record = timer.record(request, run_start_s=9.0)
    assert record.success and record.output_tokens == 4
    assert abs(record.ttft_s - 0.1) < 1e-9 and abs(record.e2e_s - 0.31) < 1e-9
    assert [round(x, 9) for x in record.itls_s] == [0.05, 0.15]
    held = StreamTimer(0.0)  # a token with held-back text still times the stream
    for t, line in ((0.1, '{"choices":[{"text":"","finish_reason":null}]}'), (0.2, '{"choices":[{"text":"é"}]}'),
                    (0.25, '{"choices":[{"text":"","finish_reason":"length"}]}'), (0.3, "[DONE]")):
        held.add(parse_sse_line("data: " + line), t)
    held_record = held.record(request, 0.0)
    assert held_record.success and held_record.output_tokens == 2 and abs(held_record.ttft_s - 0.1) < 1e-9
    assert abs(record.start_s - 1.0) < 1e-9
    cut = StreamTimer(0.0)
    cut.add(parse_sse_line('data: {"choices":[{"text":"a"}]}'), 0.1)
    assert cut.record(request, 0.0).error == "cut_off"
    empty = StreamTimer(0.0)
    empty.add(parse_sse_line("data: [DONE]"), 0.1)
    assert empty.record(request, 0.0).error == "no_output"


def test_request_body_pins_output():
    request = build_workload(WorkloadConfig(num_requests=1)).requests[0]
    body = request_body(request, EndpointConfig("http://x", "m"))
    assert body["max_tokens"] == request.output_tokens and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chat = request_body(request, EndpointConfig("http://x", "m", api="chat", ignore_eos=False))
    assert chat["messages"][0]["role"] == "user" and "ignore_eos" not in chat
