"""A long prompt is tokenized off the event loop: while its tokenizer runs, the server answers others."""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import dataclass, field

from pdserve.api.app import INLINE_PARSE_BYTES, create_app
from tests.api.servers import ByteTokenizer, FakeBackend, ServerThread, finish, tokens


class BlockingTokenizer(ByteTokenizer):
    """Encodes a long text only once `release` is set (or after 30 s), and records which came first."""

    def __init__(self):
        self.entered, self.release, self.released_in_time = threading.Event(), threading.Event(), []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if len(text) > INLINE_PARSE_BYTES:
            self.entered.set()
            self.released_in_time.append(self.release.wait(30.0))
        return super().encode(text, add_bos)


@dataclass
class SlowTokenizerBackend(FakeBackend):
    blocking: BlockingTokenizer = field(default_factory=BlockingTokenizer)

    def tokenizer(self):
        return self.blocking


def test_the_loop_serves_while_a_long_prompt_is_tokenized():
    backend = SlowTokenizerBackend(max_model_len=100_000, events=[*tokens("a", "b"), finish()])
    server = ServerThread(create_app(backend)).start()
    answers = []
    body = json.dumps({"model": "fake", "prompt": "x" * (2 * INLINE_PARSE_BYTES), "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    long_one = threading.Thread(target=lambda: answers.append(urllib.request.urlopen(request, timeout=60).status))
    try:
        long_one.start()
        assert backend.blocking.entered.wait(30.0)
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as health:  # blocked loop: no answer
            assert health.status == 200
        backend.blocking.release.set()
        long_one.join(60)
        assert answers == [200] and backend.blocking.released_in_time == [True]
    finally:
        backend.blocking.release.set()
        long_one.join(60)
        server.stop()
