"""The incremental HTTP response parser behind the raw client."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.http.httpparse import ResponseParser

BODY = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n"
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    + b"%x\r\n" % len(BODY[:20]) + BODY[:20] + b"\r\n"
    + b"%x\r\n" % len(BODY[20:]) + BODY[20:] + b"\r\n0\r\n\r\n"
)
EXPECTED = ['data: {"choices":[{"text":"a"}]}', "", "data: [DONE]", ""]


@given(st.lists(st.integers(1, len(CHUNKED) - 1), max_size=8, unique=True))
def test_chunked_any_split(cuts):
    parser, lines, start = ResponseParser(), [], 0
    for cut in sorted(cuts) + [len(CHUNKED)]:
        lines += parser.feed(CHUNKED[start:cut])
        start = cut
    assert parser.status == 200 and parser.complete and lines == EXPECTED


def test_content_length_and_read_to_close():
    sized = ResponseParser()
    lines = sized.feed(b"HTTP/1.1 500 Oops\r\nContent-Length: 9\r\n\r\n{\"e\":1}\nx")
    assert sized.status == 500 and sized.complete and lines == ['{"e":1}', "x"]
    to_close = ResponseParser()
    assert to_close.feed(b"HTTP/1.0 200 OK\r\n\r\nab\ncd") == ["ab"]
    assert not to_close.complete
    assert to_close.feed_eof() == ["cd"] and to_close.complete


def test_cut_chunked_stream_is_incomplete():
    parser = ResponseParser()
    parser.feed(CHUNKED[:-10])
    parser.feed_eof()
    assert not parser.complete


def test_malformed_input_raises_connection_error():
    with pytest.raises(ConnectionError):
        ResponseParser().feed(b"garbage\r\n\r\n")
    with pytest.raises(ConnectionError):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
