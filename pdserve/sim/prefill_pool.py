"""A pool of identical prefill instances fed by one queue (FCFS or shortest-job-first).

Contract: whenever an instance is free and the queue holds work, it starts a batch at
max(instance free time, earliest queued arrival) with every request that has arrived by then
eligible; the batch takes up to `max_batch` requests (and, when set, up to `max_batch_tokens`
new tokens, always at least one request) from the head of the queue in policy order. A batch's
results are ready after the model's full latency; the instance accepts its next batch when
the first stage frees, after `model.prefill_stage_s(latency)` (latency / pipeline_stages unless
the model keeps a serial part on the first stage). The other pp - 1 stages share the rest
equally, in order, and a batch cannot overtake the batch ahead of it: a short prompt behind a
long one waits for each stage the long one still holds (`_Pipe`), so a pipeline of ragged
prompts runs below pp / D.
Pure: no state outlives the call.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from pdserve.latency.base import LatencyModel

PREFILL_POLICIES = ("fcfs", "sjf")


@dataclass(frozen=True)
class PrefillPolicy:
    """Queue discipline and batch limits of the prefill pool."""

    order: str = "fcfs"
    max_batch: int = 1
    max_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.order not in PREFILL_POLICIES:
            raise ValueError(f"prefill policy must be one of {PREFILL_POLICIES}")
        if self.max_batch < 1:
            raise ValueError("max prefill batch must be >= 1")


@dataclass(frozen=True)
class PrefillOutcome:
    """Per request: when its prefill started and finished, and which instance ran it."""

    start_s: list[float]
    done_s: list[float]
    instance: list[int]


def run_prefill_pool(
    arrivals_s: Sequence[float],
    order: Sequence[int],
    new_tokens: Sequence[int],
    cached_tokens: Sequence[int],
    model: LatencyModel,
    instances: int,
    policy: PrefillPolicy,
) -> PrefillOutcome:
    """Simulate the requests `order` names (sorted by arrival); others keep zeros and -1."""
    n = len(arrivals_s)
    start, done, where = [0.0] * n, [0.0] * n, [-1] * n
    if policy.order == "fcfs" and policy.max_batch == 1:
        _fcfs_single(arrivals_s, order, _BatchCost(model, new_tokens, cached_tokens), model.pipeline_stages,
                     instances, (start, done, where))
        return PrefillOutcome(start, done, where)
    free = [(0.0, k) for k in range(instances)]
    queue = _Queue(policy.order, new_tokens, arrivals_s)
    cost = _BatchCost(model, new_tokens, cached_tokens)
    pipes = [_Pipe(model.pipeline_stages) for _ in range(instances)]
    nxt = 0
    while nxt < len(order) or queue:
        free_s, k = heapq.heappop(free)
        if not queue:
            queue.push(order[nxt])
            nxt += 1
        t = max(free_s, queue.earliest_s)
        while nxt < len(order) and arrivals_s[order[nxt]] <= t:
            queue.push(order[nxt])
            nxt += 1
        batch = queue.take(t, policy.max_batch, policy.max_batch_tokens)
        latency_s = cost(batch)
        first_free_s, done_s = pipes[k].run(t, latency_s, model.prefill_stage_s(latency_s))
        for i in batch:
            start[i], done[i], where[i] = t, done_s, k
        heapq.heappush(free, (first_free_s, k))
    return PrefillOutcome(start, done, where)


def _fcfs_single(arrivals_s, order, cost, stages: int, instances: int, out) -> None:
    """One request per batch in arrival order: each goes to the earliest-free instance."""
    start, done, where = out
    free = [(0.0, k) for k in range(instances)]
    pipes = [_Pipe(stages) for _ in range(instances)] if stages > 1 else None
    memo, new, cached, first_stage = cost.memo, cost.new, cost.cached, cost.model.prefill_stage_s
    for i in order:
        free_s, k = free[0]
        t = arrivals_s[i] if arrivals_s[i] > free_s else free_s
        key = (new[i], cached[i])
        latency_s = memo.get(key) or cost([i])
        if pipes is None:
            start[i], done[i], where[i] = t, t + latency_s, k
            heapq.heapreplace(free, (t + latency_s, k))
            continue
        first_free_s, done[i] = pipes[k].run(t, latency_s, first_stage(latency_s))
        start[i], where[i] = t, k
        heapq.heapreplace(free, (first_free_s, k))


class _Pipe:
    """The stages of one instance: when each finishes the last batch it took (FIFO, no overtaking)."""

    __slots__ = ("busy_until",)

    def __init__(self, stages: int) -> None:
        self.busy_until = [0.0] * stages

    def run(self, start_s: float, latency_s: float, first_s: float) -> tuple[float, float]:
        """Push a batch in at `start_s`, holding the first stage `first_s` and each later one an
        equal share of the rest; (first stage free again, last stage done)."""
        busy = self.busy_until
        t = (start_s if start_s > busy[0] else busy[0]) + first_s
        busy[0] = t
        rest_s = (latency_s - first_s) / (len(busy) - 1) if len(busy) > 1 else 0.0
        for j in range(1, len(busy)):
            t = (t if t > busy[j] else busy[j]) + rest_s
            busy[j] = t
        return busy[0], t


class _Queue:
    """Waiting requests in FCFS (arrival) or SJF (fewest new tokens, then arrival) order.

    With several instances a batch may start earlier than requests already queued arrived
    (an instance that was idle catches up), so `take` only hands out requests arrived by `t`.
    """

    __slots__ = ("fifo", "by_size", "by_arrival", "taken", "sjf", "tokens", "arrival")

    def __init__(self, order: str, new_tokens: Sequence[int], arrivals_s: Sequence[float]) -> None:
        self.sjf = order == "sjf"
        self.fifo: deque[int] = deque()
        self.by_size: list[tuple[int, int]] = []
        self.by_arrival: list[tuple[float, int]] = []
        self.taken: set[int] = set()
        self.tokens, self.arrival = new_tokens, arrivals_s

    def __bool__(self) -> bool:
        return bool(self.by_size) if self.sjf else bool(self.fifo)

    def push(self, i: int) -> None:
        if self.sjf:
            heapq.heappush(self.by_size, (self.tokens[i], i))
            heapq.heappush(self.by_arrival, (self.arrival[i], i))
        else:
            self.fifo.append(i)

    @property
    def earliest_s(self) -> float:
        """Arrival of the earliest waiting request (no batch starts before it)."""
        if not self.sjf:
            return self.arrival[self.fifo[0]]
        while self.by_arrival[0][1] in self.taken:
            self.taken.discard(heapq.heappop(self.by_arrival)[1])
        return self.by_arrival[0][0]

    def take(self, t: float, max_batch: int, max_tokens: int | None) -> list[int]:
        """Up to `max_batch` requests arrived by `t`, in policy order, within `max_tokens`."""
        batch: list[int] = []
        used = 0
        later: list[tuple[int, int]] = []
        while self and len(batch) < max_batch:
            head = self.by_size[0][1] if self.sjf else self.fifo[0]
            if self.arrival[head] > t:
                if not self.sjf:
                    break
                later.append(heapq.heappop(self.by_size))
                continue
            if batch and max_tokens is not None and used + self.tokens[head] > max_tokens:
                break
            if self.sjf:
                heapq.heappop(self.by_size)
                self.taken.add(head)
            else:
                self.fifo.popleft()
            batch.append(head)
            used += self.tokens[head]
        for item in later:
            heapq.heappush(self.by_size, item)
        return batch


class _BatchCost:
    """Batch latency with single-request results memoised by (new, cached) tokens."""

    __slots__ = ("model", "new", "cached", "memo")

    def __init__(self, model: LatencyModel, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> None:
        self.model, self.new, self.cached, self.memo = model, new_tokens, cached_tokens, {}

    def __call__(self, batch: list[int]) -> float:
        if len(batch) == 1:
            key = (self.new[batch[0]], self.cached[batch[0]])
            value = self.memo.get(key)
            if value is None:
                value = self.memo[key] = self.model.prefill_s(*key)
            return value
        return self.model.prefill_batch_s([self.new[i] for i in batch], [self.cached[i] for i in batch])
