"""A continuous decode batch advanced by whole steps, and the segment arithmetic it needs.

Contract: every step produces one token for every member. A member joins with `context`
visible tokens (prompt plus tokens generated so far) and leaves after `remaining` steps; the
batch's `context_sum` (the sum of visible lengths, which is also the K/V tokens it occupies)
grows by `size` per step. Members are never touched individually between membership changes,
so k steps cost O(1) bookkeeping; finishing members come out of a heap keyed by step index.

`segment_s(d0, d1, k)` and `steps_until(d0, d1, dt)` price k steps whose durations grow
linearly (d0, d0 + d1, d0 + 2 d1, ...): exact for latency models linear in context, and a
first-order (tangent) approximation of the roofline's max() within one segment.
"""

from __future__ import annotations

import heapq
import math

NEVER = 1 << 62  # a step count no segment reaches


class DecodeBatch:
    """Members, the global step counter and the running context sum."""

    __slots__ = ("steps", "context_sum", "size", "_finish", "_members", "_order")

    def __init__(self) -> None:
        self.steps = 0
        self.context_sum = 0
        self.size = 0
        self._finish: list[tuple[int, int]] = []
        self._members: dict[int, tuple[int, int, int]] = {}  # idx -> (join step, context, generated)
        self._order: list[int] = []

    def add(self, idx: int, context: int, generated: int, remaining: int) -> None:
        """Join now with `context` visible tokens, `generated` tokens so far, `remaining` steps."""
        self._members[idx] = (self.steps, context, generated)
        heapq.heappush(self._finish, (self.steps + remaining, idx))
        self._order.append(idx)
        self.context_sum += context
        self.size += 1

    def advance(self, k: int) -> None:
        self.steps += k
        self.context_sum += k * self.size

    def steps_to_next_finish(self) -> int:
        """Steps until the earliest member finishes (members are never stale in the heap)."""
        return self._finish[0][0] - self.steps

    def pop_finished(self) -> list[int]:
        """Remove and return members whose last step has run."""
        done = []
        while self._finish and self._finish[0][0] <= self.steps:
            idx = heapq.heappop(self._finish)[1]
            self._drop(idx)
            done.append(idx)
        return done

    def preempt_newest(self) -> tuple[int, int]:
        """Evict the most recently joined member; returns (idx, tokens generated so far)."""
        while self._order[-1] not in self._members:
            self._order.pop()
        idx = self._order.pop()
        generated = self._drop(idx)
        self._finish = [(s, i) for s, i in self._finish if i != idx]
        heapq.heapify(self._finish)
        return idx, generated

    def _drop(self, idx: int) -> int:
        join, context, generated = self._members.pop(idx)
        ran = self.steps - join
        self.context_sum -= context + ran
        self.size -= 1
        return generated + ran


def segment_s(d0: float, d1: float, k: int) -> float:
    """Duration of k steps lasting d0, d0 + d1, ..., d0 + (k-1) d1."""
    return k * d0 + d1 * k * (k - 1) / 2


def steps_until(d0: float, d1: float, dt: float) -> int:
    """Smallest k >= 1 whose segment lasts at least `dt` (the first step boundary at/after dt)."""
    if dt <= 0:
        return 1
    if d0 <= 0 and d1 <= 0:
        return NEVER
    if d1 <= d0 * 1e-12:
        return max(1, math.ceil(dt / d0 - 1e-12))
    b = d0 - d1 / 2
    k = math.ceil((-b + math.sqrt(b * b + 2 * d1 * dt)) / d1 - 1e-12)
    return max(1, k)
