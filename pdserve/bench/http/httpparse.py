"""Incremental parsing of an HTTP/1.1 response into status, headers and body lines.

Contract: `ResponseParser.feed(data)` accepts any split of the byte stream and returns the body
lines completed by `data` (text, without line endings). Bodies may be chunked, sized by
Content-Length, or (neither) delimited by connection close, which the owner reports with
`feed_eof()`. `complete` turns true exactly when the body has ended cleanly; malformed input
raises `ConnectionError`. Pure: no I/O, no clock.
"""

from __future__ import annotations

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER, _SIZED, _TO_CLOSE, _DONE = range(7)


class ResponseParser:
    """One response's parse state."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.complete = False
        self._state = _HEAD
        self._buffer = b""
        self._remaining = 0
        self._partial_line = b""

    @property
    def started(self) -> bool:
        """Whether any byte of the response has arrived."""
        return self._state != _HEAD or bool(self._buffer)

    @property
    def head_done(self) -> bool:
        return self._state != _HEAD

    def feed(self, data: bytes) -> list[str]:
        """Consume `data`; return the body lines it completed."""
        self._buffer += data
        lines: list[str] = []
        while self._step(lines):
            pass
        return lines

    def feed_eof(self) -> list[str]:
        """The connection closed: ends a read-to-close body, else leaves `complete` false."""
        if self._state == _TO_CLOSE:
            lines = self._body(self._buffer) + self._flush()
            self._buffer = b""
            self._finish()
            return lines
        return []

    def _step(self, lines: list[str]) -> bool:
        """Advance one state if the buffer allows; False when more bytes are needed."""
        if self._state == _HEAD:
            return self._parse_head()
        if self._state == _CHUNK_SIZE:
            return self._parse_chunk_size()
        if self._state == _CHUNK_DATA:
            return self._take_chunk(lines)
        if self._state == _TRAILER:
            return self._skip_trailer(lines)
        if self._state in (_SIZED, _TO_CLOSE):
            return self._take_plain(lines)
        return False

    def _parse_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        head, self._buffer = self._buffer[:end].decode("latin-1"), self._buffer[end + 4 :]
        status_line, *header_lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ConnectionError(f"bad status line {status_line!r}")
        self.status = int(parts[1])
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()
        self._state = self._body_state()
        if self._state == _SIZED and self._remaining == 0:
            self._finish()
        return True

    def _body_state(self) -> int:
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            return _CHUNK_SIZE
        if "content-length" in self.headers:
            self._remaining = int(self.headers["content-length"])
            return _SIZED
        return _TO_CLOSE

    def _parse_chunk_size(self) -> bool:
        end = self._buffer.find(b"\r\n")
        if end < 0:
            return False
        size_text = self._buffer[:end].split(b";", 1)[0].strip()
        self._buffer = self._buffer[end + 2 :]
        try:
            self._remaining = int(size_text, 16)
        except ValueError as exc:
            raise ConnectionError(f"bad chunk size {size_text!r}") from exc
        self._state = _TRAILER if self._remaining == 0 else _CHUNK_DATA
        return True

    def _take_chunk(self, lines: list[str]) -> bool:
        if len(self._buffer) < self._remaining + 2:
            return False
        data, self._buffer = self._buffer[: self._remaining], self._buffer[self._remaining + 2 :]
        lines.extend(self._body(data))
        self._state = _CHUNK_SIZE
        return True

    def _skip_trailer(self, lines: list[str]) -> bool:
        end = self._buffer.find(b"\r\n")
        if end < 0:
            return False
        self._buffer = self._buffer[end + 2 :]
        if end == 0:
            lines.extend(self._flush())
            self._finish()
        return True

    def _take_plain(self, lines: list[str]) -> bool:
        if not self._buffer:
            return False
        take = len(self._buffer) if self._state == _TO_CLOSE else min(self._remaining, len(self._buffer))
        data, self._buffer = self._buffer[:take], self._buffer[take:]
        lines.extend(self._body(data))
        if self._state == _SIZED:
            self._remaining -= take
            if self._remaining == 0:
                lines.extend(self._flush())
                self._finish()
        return self._state != _DONE and bool(self._buffer)

    def _body(self, data: bytes) -> list[str]:
        pending = self._partial_line + data
        *complete, self._partial_line = pending.split(b"\n")
        return [line.rstrip(b"\r").decode("utf-8", errors="replace") for line in complete]

    def _flush(self) -> list[str]:
        rest, self._partial_line = self._partial_line, b""
        return [rest.rstrip(b"\r").decode("utf-8", errors="replace")] if rest else []

    def _finish(self) -> None:
        self._state = _DONE
        self.complete = True
