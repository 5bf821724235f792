"""A decode worker's view of its requests' holds under `--reserve dynamic` (TetriInfer).

Contract: a `ReserveKv` whose `reserve_tokens` is set (0 < reserve_tokens) sizes the engine's
import reservation for that many output tokens instead of `max_tokens` (`hold_params`); the
request's real parameters still govern decoding (commit_import gets them). `HoldWatch` then
follows each such request after every engine step: blocks in its table past the hold are a
growth (the engine took them from blocks no other request had reserved: `BlockManager.allocate`
consumes the owner's reservation first, then unreserved free blocks), and a preemption is the
scheduler's recompute path (no block to grow into: engine/scheduler.py preempts the newest other
running sequence, or the request itself, and recomputes it later from its tokens). `counts(rid)`
gives the cumulative (grown blocks, preemptions) every token message for the request carries, so
the router sees each growth with the token that needed it (router/tetri/tetri_runtime.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.sequence import SamplingParams


def hold_params(params: SamplingParams, reserve_tokens: int) -> SamplingParams:
    """The parameters the engine's import reservation is sized from: the hold's output tokens in
    place of max_tokens (never more than max_tokens); unchanged when no hold is given."""
    if reserve_tokens <= 0 or reserve_tokens >= params.max_tokens:
        return params
    return replace(params, max_tokens=reserve_tokens, min_tokens=min(params.min_tokens, reserve_tokens))


@dataclass
class _Watch:
    hold_blocks: int  # prompt blocks + reserved growth at admission
    grown_blocks: int = 0
    preemptions: int = 0
    done: bool = False


class HoldWatch:
    def __init__(self) -> None:
        self._watches: dict[str, _Watch] = {}
        self.num_growths = 0  # growth events (a step in which some request's hold grew), since start
        self.num_preemptions = 0  # preemptions of watched requests, since start

    def watch(self, request_id: str, hold_blocks: int) -> None:
        self._watches[request_id] = _Watch(hold_blocks)

    def after_step(self, engine, finished: list[str]) -> None:
        """Called under the worker lock after each engine step: drop requests that finished in an
        earlier step (their last counts went out with their last tokens), note growths and
        preemptions, and mark `finished` for dropping at the next step."""
        for rid in [r for r, w in self._watches.items() if w.done]:
            del self._watches[rid]
        for rid, w in self._watches.items():
            seq = engine.seqs.get(rid)
            if seq is None:
                continue
            over = len(seq.block_table) - w.hold_blocks
            if over > w.grown_blocks:
                w.grown_blocks = over
                self.num_growths += 1
            if seq.num_preemptions > w.preemptions:
                self.num_preemptions += seq.num_preemptions - w.preemptions
                w.preemptions = seq.num_preemptions
        for rid in finished:
            if rid in self._watches:
                self._watches[rid].done = True

    def counts(self, request_id: str) -> tuple[int, int]:
        """(blocks grown past the hold, preemptions) so far; (0, 0) for an unwatched request."""
        w = self._watches.get(request_id)
        return (0, 0) if w is None else (w.grown_blocks, w.preemptions)

    def forget(self, request_id: str) -> None:
        self._watches.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._watches)
