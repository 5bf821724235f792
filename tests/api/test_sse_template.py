"""`delta_event` (a streamed token spliced into a per-choice template) is `sse(delta(...))` byte for byte."""

from __future__ import annotations

import itertools

import pytest

from pdserve.api.responses import ChatFormat, ResponseFormat, sse

TEXTS = ["a", " b", '"', "\\", "\n\t", "\x00\x1f", "é", "😀", "\u2028", "\ue000pdserve-text\ue000", "</s>", "a" * 300, ""]
IDS = [(), (97,), (97, 2047, 0)]


@pytest.mark.parametrize("cls,return_ids,usage", list(itertools.product((ResponseFormat, ChatFormat), (False, True),
                                                                         (False, True))))
def test_delta_event_equals_the_whole_chunk_encoded(cls, return_ids, usage):
    fmt = cls("cmpl-1\"x", "model/é", return_token_ids=return_ids, include_usage=usage, created=1700000000)
    for text, ids, index in itertools.product(TEXTS, IDS, (0, 3)):
        assert fmt.delta_event(text, ids, index) == sse(fmt.delta(text, ids, index)), (text, ids, index)


@pytest.mark.parametrize("cls", (ResponseFormat, ChatFormat))
def test_delta_event_with_logprobs_equals_the_whole_chunk_encoded(cls):
    fmt = cls("cmpl-1", "m", return_token_ids=True)
    logprobs = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}
    assert fmt.delta_event("a", (97,), 1, logprobs) == sse(fmt.delta("a", (97,), 1, logprobs))


def test_templates_are_per_choice_and_per_request():
    a, b = ResponseFormat("cmpl-a", "m"), ResponseFormat("cmpl-b", "m")
    assert b'"id":"cmpl-a"' in a.delta_event("x", ()) and b'"id":"cmpl-b"' in b.delta_event("x", ())
    assert b'"index":2' in a.delta_event("x", (), 2) and b'"index":0' in a.delta_event("x", (), 0)
