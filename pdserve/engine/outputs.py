"""What the engine reports to its caller after a step, and what a prefill exports for handoff."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]  # produced by this step
    output_ids: tuple[int, ...]  # all output so far
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prefilled: bool = False  # prefill-only request holding its K/V for export


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
