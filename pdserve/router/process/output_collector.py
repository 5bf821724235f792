"""One in-flight request's events between the worker messages that make them and the client that takes them.

Contract (vLLM's `RequestOutputCollector`, with a margin): `put` never blocks and never waits for
the client, so a slow reader cannot slow its worker or the other requests in its batch. Each
choice (`index`; n > 1 has n) keeps its TokenEvents separate while fewer than `MAX_SEPARATE` of
them wait for the client; past that, its next tokens are merged into its newest untaken delta:
text concatenated, token ids and logprobs appended, the finish_reason and prompt logprobs kept,
the merged tail held in flat arrays (about the size of its JSON, not a few Python objects per
token). So a client that keeps up, or lags a few steps behind a burst, gets every event as it was
put (the same object: one SSE event per decode step, as the relay promises), and what a client
that stopped reading holds in the router is bounded by its response's own size. `get` hands out
the untaken deltas in the order their first token arrived (each choice's text stays in order, and
so does which choice spoke first), then the terminal event (FinishEvent or ErrorEvent) once none
is left, so a terminal is never seen before the tokens put ahead of it. The first terminal is the
request's end: anything put after it is dropped, as a consumer that stopped at it never read it.
"""

from __future__ import annotations

import asyncio
import io
from array import array
from collections import deque

from pdserve.engine.outputs import TokenLogprobs
from pdserve.router.contract import ErrorEvent, FinishEvent, GenerationEvent, TokenEvent

# A choice's events the client may lag behind before its tokens merge: a consumer woken once per
# burst of worker messages (a busy event loop, a few steps at a time) never merges, so benchmark
# clients still time one event per decode step; the events held as they came stay bounded.
MAX_SEPARATE = 16


class _FlatLogprobs:
    """TokenLogprobs in flat arrays: 4 or 8 bytes a number, where each token's Python objects take
    ~1 KB at top-20 (a lagging client's pending logprobs cost about what their JSON will)."""

    def __init__(self) -> None:
        self.token_ids = array("i")  # [T]; vocabulary ids fit int32
        self.values = array("d")  # [T]; float64 holds a Python float exactly
        self.num_top = array("i")  # [T]
        self.top_ids = array("i")  # [sum(num_top)]
        self.top_values = array("d")  # [sum(num_top)]

    def extend(self, logprobs: tuple[TokenLogprobs, ...]) -> None:
        for lp in logprobs:
            self.token_ids.append(lp.token_id)
            self.values.append(lp.logprob)
            self.num_top.append(len(lp.top_ids))
            self.top_ids.extend(lp.top_ids)
            self.top_values.extend(lp.top_logprobs)

    def tokens(self) -> tuple[TokenLogprobs, ...]:
        out, at = [], 0
        for token_id, value, k in zip(self.token_ids, self.values, self.num_top):
            out.append(TokenLogprobs(token_id, value, tuple(self.top_ids[at : at + k]), tuple(self.top_values[at : at + k])))
            at += k
        return tuple(out)


class _Delta:
    """One choice's TokenEvents the client has not taken: the first as it came (a client that
    keeps up gets it untouched), the ones after it folded into one compact tail."""

    def __init__(self, first: TokenEvent) -> None:
        self.first = first
        self.index = first.index
        self.num_merged = 0
        self.token_ids = array("i")
        self.text = io.StringIO()  # appends in amortized constant time
        self.logprobs = _FlatLogprobs()
        self.finish_reason = first.finish_reason
        self.prompt_logprobs = first.prompt_logprobs

    def merge(self, event: TokenEvent) -> None:
        self.num_merged += 1
        self.token_ids.extend(event.token_ids)
        self.text.write(event.text)
        self.logprobs.extend(event.logprobs)
        self.finish_reason = event.finish_reason or self.finish_reason
        if self.prompt_logprobs is None:  # sent once, with sequence 0's first token
            self.prompt_logprobs = event.prompt_logprobs

    def event(self) -> TokenEvent:
        if not self.num_merged:
            return self.first
        first = self.first
        return TokenEvent(first.token_ids + tuple(self.token_ids), first.text + self.text.getvalue(), first.index,
                          self.finish_reason, first.logprobs + self.logprobs.tokens(), self.prompt_logprobs)


class OutputCollector:
    def __init__(self) -> None:
        self._pending: deque[_Delta] = deque()  # untaken deltas, in the order their first token arrived
        self._newest: dict[int, _Delta] = {}  # choice index -> its newest untaken delta (the one tokens merge into)
        self._num_waiting: dict[int, int] = {}  # choice index -> its untaken deltas
        self._terminal: FinishEvent | ErrorEvent | None = None
        self._ready = asyncio.Event()  # set while `get` has something to hand out

    def put(self, event: GenerationEvent) -> None:
        """Add an event without waiting; a TokenEvent merges into its choice's newest untaken delta
        once `MAX_SEPARATE` of that choice's deltas wait."""
        if self._terminal is not None:
            return
        if not isinstance(event, TokenEvent):
            self._terminal = event
        elif self._num_waiting.get(event.index, 0) >= MAX_SEPARATE:
            self._newest[event.index].merge(event)
        else:
            delta = self._newest[event.index] = _Delta(event)
            self._pending.append(delta)
            self._num_waiting[event.index] = self._num_waiting.get(event.index, 0) + 1
        self._ready.set()

    async def get(self) -> GenerationEvent:
        """The oldest untaken delta, else the terminal event; waits while there is neither."""
        while not self._pending and self._terminal is None:
            self._ready.clear()
            await self._ready.wait()
        if not self._pending:
            return self._terminal
        delta = self._pending.popleft()
        self._num_waiting[delta.index] -= 1
        if not self._num_waiting[delta.index]:  # it was the choice's newest too
            del self._num_waiting[delta.index], self._newest[delta.index]
        return delta.event()
