"""Length-bucketed prefill admission (TetriInfer's prefill batching, `--prefill-length-buckets`).

Contract (pure): sequences fall into buckets [b_0 = 0, b_1), [b_1, b_2), ... by their length in
tokens (prompt, plus outputs for a recompute) (`length_bucket`). Within one engine step the scheduler admits the head of the waiting
queue first, as always (nobody is overtaken forever: the head goes first in every step); every
further admission in that step is `next_admission`: the oldest waiting prompt in the step's bucket
(the bucket of the first prompt the step prefills), else, work-conserving, the head again.
pdserve's prefill step is one flat, unpadded token budget, so this saves no padding; what it
changes is which prompts share a step: short prompts are admitted together instead of filling
the budget left beside a long prompt's chunk, so a burst of short prompts reaches its first tokens
in fewer steps, while a long prompt's chunks run with other long prompts. Total work is unchanged.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq


def length_bucket(num_tokens: int, bounds: Seq[int]) -> int:
    """Index g with bounds[g] <= num_tokens < bounds[g + 1]; past the last bound: the last bucket."""
    return max(0, bisect.bisect_right(bounds, num_tokens) - 1)


def next_admission(waiting_tokens: Seq[int], step_bucket: int | None, bounds: Seq[int]) -> int:
    """Index into the waiting queue (each waiting sequence's length, queue order) of the
    next sequence to admit in a step whose bucket is `step_bucket` (None: nothing admitted yet)."""
    if step_bucket is None or not bounds:
        return 0
    for i, tokens in enumerate(waiting_tokens):
        if length_bucket(tokens, bounds) == step_bucket:
            return i
    return 0


def validate_bounds(bounds: Seq[int]) -> None:
    if bounds and (bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"prefill length buckets must start at 0 and increase, got {list(bounds)}")
