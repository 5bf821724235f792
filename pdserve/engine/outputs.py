"""What the engine reports to its caller after a step, and what a prefill exports for handoff."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability and the k most likely at its position (engine/logprobs.py makes it)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()  # the k most likely tokens at this position, most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One sequence's progress in one step. For an n > 1 request each of its sequences reports
    on its own (`index`); `finish_reason` is that sequence's end, `finished` the request's (its
    last sequence ended). With n = 1 the two go together."""

    request_id: str
    new_token_ids: tuple[int, ...]  # produced by this step
    output_ids: tuple[int, ...]  # all output so far
    new_text: str
    text: str
    finished: bool  # the request is done: no sequence of it runs any more
    finish_reason: str | None  # this sequence's end: "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prefilled: bool = False  # prefill-only request holding its K/V for export
    index: int = 0  # which of the request's n sequences
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt positions 1.., on sequence 0's first output
    forks: tuple[tuple[int, int], ...] = ()  # prefilled n > 1 request: (index, first token) of sequences that go on


def sequence_output(seq: Sequence, token: int, new_text: str, done: bool, reason: str | None, prefilled: bool,
                    logprobs: tuple[TokenLogprobs, ...], forks: tuple[tuple[int, int], ...],
                    with_prompt: bool) -> RequestOutput:
    """The output of `seq` for the token it just appended. `with_prompt`: this is the request's
    first output, which carries the prompt logprobs (when the request asked for them)."""
    with_prompt = with_prompt and seq.params.prompt_logprobs is not None
    return RequestOutput(
        request_id=seq.caller_id, new_token_ids=(token,), output_ids=tuple(seq.output_ids), new_text=new_text,
        text=seq.text, finished=done, finish_reason=reason, num_prompt_tokens=len(seq.prompt_ids),
        num_cached_tokens=seq.num_cached_tokens, prefilled=prefilled, index=seq.index, logprobs=logprobs,
        prompt_logprobs=tuple(seq.prompt_logprobs) if with_prompt else None, forks=forks,
    )


@dataclass(frozen=True)
class KvExport:
    """A prefilled request's K/V in the source pool: what a handoff needs to move it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    first_token: int
    seed: int
    block_ids: tuple[int, ...]  # source pool blocks covering the prompt, in order
    block_hashes: tuple[bytes, ...]  # chain hashes of the full prompt blocks
    num_tokens: int  # prompt tokens whose K/V is exported


@dataclass(frozen=True)
class ImportReservation:
    """Destination blocks held for an incoming handoff (unpublished until commit)."""

    request_id: str
    block_ids: tuple[int, ...]  # all prompt blocks at the destination, in order
    num_visible_blocks: int  # leading blocks already exact at the destination (prefix hits)
    growth_blocks: int  # capacity reserved for decode growth

    @property
    def transfer_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[self.num_visible_blocks :]


@dataclass(frozen=True)
class PrefillProgress:
    """One prompt's prefill in the current step, as the per-layer hook sees it."""

    request_id: str
    computed_tokens: int  # prompt tokens with final K/V in every layer the hook has reached
    completes: bool  # this step computes the prompt's last token
