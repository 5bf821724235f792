"""Choices on their own (no engine): n > 1 streams close each choice when its sequence ends,
echo and max_tokens 0, usage counting, and logprob entries in both shapes."""

from __future__ import annotations

import asyncio
import json

from pdserve.api.backend import FinishEvent, TokenEvent
from pdserve.api.choices import Choices
from pdserve.api.logprob_format import TokenNames
from pdserve.api.protocol import Echo, ParsedRequest
from pdserve.api.relay import collect, sse_events
from pdserve.api.responses import ChatFormat, ResponseFormat
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.sequence import SamplingParams


class ScriptedStream:
    """The part of RequestStream relay.py reads: the events after the first."""

    def __init__(self, events):
        self.events = list(events)
        self.closed = False

    async def next(self):
        return self.events.pop(0)

    async def close(self):
        self.closed = True


def parsed(n=1, logprobs=None, echo=None, drop_output=False, prompt_logprobs=None, stream=True) -> ParsedRequest:
    params = SamplingParams(max_tokens=4, n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    return ParsedRequest((7, 8, 9), params, stream, False, False, echo=echo, drop_output=drop_output)


def lp(token: int, value: float) -> TokenLogprobs:
    return TokenLogprobs(token, value, (token,), (value,))


def stream_chunks(req, fmt, events) -> list[dict]:
    async def run():
        stream = ScriptedStream(events[1:])
        out = [chunk async for chunk in sse_events(stream, events[0], fmt, Choices(req, fmt, TokenNames(None)))]
        assert stream.closed
        return out
    chunks = asyncio.run(run())
    assert chunks[-1] == b"data: [DONE]\n\n"
    return [json.loads(c[len(b"data: "):]) for c in chunks[:-1]]


def test_a_choice_that_ends_early_is_closed_at_once():
    events = [TokenEvent((1,), "a", 0), TokenEvent((2,), "b", 1, "stop"), TokenEvent((3,), "c", 0),
              TokenEvent((4,), "d", 0, "length"), FinishEvent("length", 3, 1)]
    chunks = stream_chunks(parsed(n=2), ResponseFormat("cmpl-1", "m"), events)
    seen = [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert seen == [(0, "a", None), (1, "b", None), (1, "", "stop"), (0, "c", None), (0, "d", None), (0, "", "length")]


def test_whole_response_counts_every_choice_and_echo_leads_with_prompt_logprobs():
    req = parsed(n=2, logprobs=0, echo=Echo("xyz", (7, 8, 9)), prompt_logprobs=0, stream=False)
    fmt = ResponseFormat("cmpl-1", "m")
    events = [TokenEvent((5,), "Q", 1, None, (lp(5, -1.0),), (lp(8, -2.0), lp(9, -3.0))),
              TokenEvent((6,), "R", 0, "length", (lp(6, -0.5),)), TokenEvent((4,), "S", 1, "stop", (lp(4, -0.25),)),
              FinishEvent("stop", 3, 1)]
    result = asyncio.run(collect(ScriptedStream(events[1:]), events[0], Choices(req, fmt, TokenNames(None))))
    assert result.usage.completion_tokens == 3  # n > 1: every choice's tokens, not the backend's count of one
    body = fmt.response(result.choices, result.usage)
    first, second = body["choices"]
    assert (first["text"], first["finish_reason"], second["text"], second["finish_reason"]) == ("xyzR", "length", "xyzQS", "stop")
    assert first["logprobs"]["tokens"] == ["token_id:7", "token_id:8", "token_id:9", "token_id:6"]
    assert first["logprobs"]["token_logprobs"] == [None, -2.0, -3.0, -0.5]
    assert first["logprobs"]["top_logprobs"] == [None, {"token_id:8": -2.0}, {"token_id:9": -3.0}, {"token_id:6": -0.5}]
    assert first["logprobs"]["text_offset"] == [0, 10, 20, 30]
    assert second["logprobs"]["token_logprobs"] == [None, -2.0, -3.0, -1.0, -0.25]


def test_max_tokens_zero_returns_the_echo_alone():
    req = parsed(echo=Echo("xyz", (7, 8, 9)), drop_output=True, stream=False)
    fmt = ResponseFormat("cmpl-1", "m")
    events = [TokenEvent((5,), "Q", 0, "length"), FinishEvent("length", 3, 1)]
    result = asyncio.run(collect(ScriptedStream(events[1:]), events[0], Choices(req, fmt, TokenNames(None))))
    assert [(c.text, c.token_ids, c.finish_reason) for c in result.choices] == [("xyz", [], "length")]
    assert result.usage.completion_tokens == 0


def test_chat_logprob_entries():
    req = parsed(logprobs=1)
    fmt = ChatFormat("chatcmpl-1", "m")
    events = [TokenEvent((5,), "Q", 0, "length", (TokenLogprobs(5, -1.0, (6, 5), (-0.5, -1.0)),)), FinishEvent("length", 3, 1)]
    chunks = stream_chunks(req, fmt, events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1]["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "token_id:5", "logprob": -1.0, "bytes": list(b"token_id:5"),
                        "top_logprobs": [{"token": "token_id:6", "logprob": -0.5, "bytes": list(b"token_id:6")},
                                         {"token": "token_id:5", "logprob": -1.0, "bytes": list(b"token_id:5")}]}]


def test_a_stream_keeps_none_of_what_it_sent():
    """A stream sends each piece and forgets it (before, every piece, id and logprob stayed in the
    serving process until the stream ended: the whole response, however slowly it was read); the
    same events collected for a whole response keep everything."""
    events = [TokenEvent((i,), f"t{i}", i % 2, logprobs=(lp(i, -0.5),)) for i in range(200)]
    events.append(FinishEvent("length", 3, 200))
    req = parsed(n=2, logprobs=1)
    fmt = ResponseFormat("cmpl-1", "m")
    choices = Choices(req, fmt, TokenNames(None))
    for event in events[:-1]:
        choices.take(event)
    assert all(not c.pieces and not c.token_ids and not c.entries for c in choices.choices)
    assert choices.num_tokens == 200
    whole = Choices(parsed(n=2, logprobs=1, stream=False), fmt, TokenNames(None))
    for event in events[:-1]:
        whole.take(event)
    assert [len(c.token_ids) for c in whole.whole()] == [100, 100]
