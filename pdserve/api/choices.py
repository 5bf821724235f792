"""One request's n choices, built from backend events: text, ids, logprobs, echo, finish.

Contract: `Choices.take(event)` folds one TokenEvent into its choice (`event.index`) and returns
the streamed piece for it (text, ids, logprobs object), or None when nothing is to be sent;
`closes(event)` says whether a stream closes that choice now (n > 1: a choice whose sequence
ended while others run gets its finish_reason chunk at once, as vLLM sends it); `finish(event)`
closes every other choice, with the FinishEvent's reason where the choice had none of its own; `whole()` gives the whole response's choices and `usage(event)` its usage. The echo
leads each choice's first piece: completions' prompt text, with the prompt tokens' logprobs
(first token null) when logprobs were asked for; chat's echoed message content. With
`drop_output` (max_tokens 0) the sampled token is dropped: a choice is its echo alone,
finish_reason "length", and no completion tokens are counted.
Usage: n = 1 takes the backend's count (it knows resumed tokens); n > 1 counts every choice's
tokens as they arrived. A streamed request keeps none of its pieces (only `whole()` reads them, for
a response sent at once): a stream of n = 32 x 2,000 tokens with logprobs would otherwise hold the
whole response's objects in the serving process until it ends, however slowly its client reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.api.backend import FinishEvent, TokenEvent
from pdserve.api.logprob_format import TokenNames, prompt_entries
from pdserve.api.protocol import ParsedRequest
from pdserve.api.responses import FullChoice, ResponseFormat, Usage


@dataclass(frozen=True)
class Piece:
    """What one event adds to one choice of a stream."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: dict | None


@dataclass
class _Choice:
    index: int
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    entries: list = field(default_factory=list)  # TokenLogprobs, or a bare prompt id (null logprob)
    finish_reason: str | None = None
    num_chars: int = 0  # characters of the token strings so far (completions' text_offset continues from here)
    echoed: bool = False
    closed: bool = False  # its finish_reason chunk was streamed


class Choices:
    def __init__(self, parsed: ParsedRequest, fmt: ResponseFormat, names: TokenNames):
        self.parsed = parsed
        self.fmt = fmt
        self.names = names
        self.choices = [_Choice(i) for i in range(parsed.n)]
        self.prompt_logprobs = None  # from sequence 0's first event; every echoing choice repeats it
        self.num_tokens = 0

    @property
    def wants_logprobs(self) -> bool:
        return self.parsed.params.logprobs is not None

    def take(self, event: TokenEvent) -> Piece | None:
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        choice = self.choices[event.index]
        self.num_tokens += len(event.token_ids)
        if event.finish_reason is not None:
            choice.finish_reason = "length" if self.parsed.drop_output else event.finish_reason
        if self.parsed.drop_output:
            return self._piece(choice, "", (), [])
        return self._piece(choice, event.text, tuple(event.token_ids), list(event.logprobs))

    def _piece(self, choice: _Choice, text: str, token_ids: tuple[int, ...], entries: list) -> Piece | None:
        if not choice.echoed and self.parsed.echo is not None:
            choice.echoed = True
            text = self.parsed.echo.text + text
            if self.wants_logprobs and self.parsed.echo.prompt_ids:
                entries = prompt_entries(self.parsed.echo.prompt_ids, self.prompt_logprobs) + entries
        if not text and not token_ids and not entries:
            return None
        body = self.fmt.logprobs_body(entries, self.names, choice.num_chars) if self.wants_logprobs else None
        if not self.parsed.stream:  # for whole(); a stream sends each piece and forgets it
            choice.pieces.append(text)
            choice.token_ids.extend(token_ids)
            choice.entries.extend(entries)
        choice.num_chars += sum(len(self.names(e if isinstance(e, int) else e.token_id)) for e in entries)
        return Piece(choice.index, text, token_ids, body)

    def closes(self, event: TokenEvent) -> bool:
        """n > 1: this event ended its choice; a stream closes it now (and not again at the end)."""
        choice = self.choices[event.index]
        if self.parsed.n == 1 or choice.finish_reason is None or choice.closed:
            return False
        choice.closed = True
        return True

    def finish(self, event: FinishEvent) -> list[Piece]:
        """The closing piece of each choice not closed yet (its remaining echo and text), reasons
        settled."""
        closing = []
        for choice in self.choices:
            if choice.closed:
                continue
            reason = choice.finish_reason or event.finish_reason
            choice.finish_reason = "length" if self.parsed.drop_output else reason
            text = event.text if choice.index == 0 and not self.parsed.drop_output else ""
            piece = self._piece(choice, text, (), [])
            closing.append(piece or Piece(choice.index, "", (), None))
        return closing

    def whole(self) -> list[FullChoice]:
        assert not self.parsed.stream, "a streamed request keeps no pieces"
        return [FullChoice(c.index, "".join(c.pieces), c.token_ids, c.finish_reason or "stop",
                           self.fmt.logprobs_body(c.entries, self.names, 0) if self.wants_logprobs else None)
                for c in self.choices]

    def usage(self, event: FinishEvent) -> Usage:
        if self.parsed.drop_output:
            return Usage(event.prompt_tokens, 0, event.cached_tokens)
        return Usage(event.prompt_tokens, event.completion_tokens if self.parsed.n == 1 else self.num_tokens,
                     event.cached_tokens)
