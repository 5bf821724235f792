"""A disaggregated deployment whose router decides per request: hand off, or prefill on D (issue 20).

Contract: `run_margin_routed` simulates `prefill_replicas` prefill instances and `decode_replicas`
decode instances with one event clock, so a decision can read D's live state at the arrival.
Arrivals are taken in time order; arrival number n goes to decode instance n mod decode_replicas
(the router's pair is chosen before the decision; the oblivious simulator deals its handoffs
round-robin in prefill completion order, which is arrival order with one prefill instance). At each arrival the chosen D is advanced to the first step boundary at or
after it, and `decide(ArrivalView)` is asked with what the router reads at that instant:

    decode_batch            D's decoding sequences (its load report's active batch)
    decode_routed           live routes to D: decoding there, queued or prefilling there, at P,
                            or in transit (the router's ledger counts a route until it completes)
    decode_pending_tokens   prompt rows queued or part-way at D (its local prefills)
    prefill_pending_tokens  prompt rows queued or part-way at the prefill instance the request
                            would take (the earliest free); a running prefill counts the share of
                            its rows not yet run, pro rata over its time (an engine reports its
                            uncomputed rows chunk by chunk)

The decision itself is the caller's: this module holds no formula of it (search/margin_routing.py
passes the router's own `decide_pd`). True: the request goes to P (FCFS, one request per batch,
to the earliest free instance, as prefill_pool.py's single-request FCFS), its first token at P's
finish, then over D's ingress link (transfer.py, in order of prefill completion, layer-wise
overlap as configured) and joins D decode-only (colocated.py `MixedInstance.add_join`). False:
its prompt queues at D and runs in chunks beside D's decodes (`MixedInstance.add_prompt`).
Requirements: a prefill model of one pipeline stage (a profiled fit: what `pdserve serve`
prices its decisions with). Pure: no state outlives the call.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from pdserve.latency.base import LatencyModel
from pdserve.sim.colocated import ColocatedLimits, MixedInstance
from pdserve.sim.transfer import IngressLinks, LinkSpec


@dataclass(frozen=True)
class ArrivalView:
    """What the router reads at one request's arrival (module contract), and the request."""

    request: int
    now_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    decode_batch: int
    decode_routed: int
    decode_pending_tokens: int
    prefill_pending_tokens: int


Decide = Callable[[ArrivalView], bool]  # True: disaggregate


@dataclass(frozen=True)
class RoutedShape:
    """Pools, D's scheduler limits and the handoff link."""

    prefill_replicas: int = 1
    decode_replicas: int = 1
    chunk_tokens: int = 512
    max_seqs: int = 256
    link: LinkSpec = LinkSpec()


@dataclass(frozen=True)
class RoutedRun:
    """Per request (index order; unrouted ones keep zeros): first token, finish, and the route."""

    first_token_s: list[float]
    finish_s: list[float]
    disaggregated: list[bool]
    views: tuple[ArrivalView, ...]  # in arrival order
    num_preempted: int
    mean_transfer_exposed_s: float


class _PrefillPool:
    """FCFS single-request prefill over identical one-stage instances, stepped one request at a time."""

    def __init__(self, model: LatencyModel, instances: int) -> None:
        if model.pipeline_stages != 1:
            raise ValueError("margin routing needs a one-stage prefill model")
        self.model, self.memo = model, {}
        self.free = [(0.0, k) for k in range(instances)]
        self.live = [deque() for _ in range(instances)]  # per instance, FCFS: (start, done, rows) not yet done
        self.rows = [0] * instances  # rows in `live`

    def pending_tokens(self, now_s: float) -> int:
        """Uncomputed rows at the instance the next request takes (module contract): only the
        oldest of its unfinished prefills can be running (FCFS, one at a time)."""
        k = self.free[0][1]
        live = self.live[k]
        while live and live[0][1] <= now_s:
            self.rows[k] -= live.popleft()[2]
        if not live or live[0][0] >= now_s:
            return self.rows[k]
        start, done, rows = live[0]
        return self.rows[k] - rows + math.ceil(rows * (done - now_s) / (done - start))

    def run(self, arrival_s: float, new_tokens: int, cached_tokens: int) -> tuple[float, float]:
        """(start, done) of one request's prefill."""
        free_s, k = self.free[0]
        start = arrival_s if arrival_s > free_s else free_s
        latency_s = self.memo.get((new_tokens, cached_tokens))
        if latency_s is None:
            latency_s = self.memo[(new_tokens, cached_tokens)] = self.model.prefill_s(new_tokens, cached_tokens)
        heapq.heapreplace(self.free, (start + latency_s, k))
        self.live[k].append((start, start + latency_s, new_tokens))
        self.rows[k] += new_tokens
        return start, start + latency_s


class _Links(IngressLinks):
    """The decode instances' ingress links; a transfer leaves when its prefill is done."""

    def __init__(self, link: LinkSpec, kv_bytes_per_token: int, decode: list[MixedInstance]) -> None:
        super().__init__(link, kv_bytes_per_token, len(decode))
        self.decode = decode
        self.waiting: list[tuple[float, int, float, int]] = []  # heap of (done, request, start, decode instance)

    def push(self, done_s: float, idx: int, start_s: float, k: int) -> None:
        heapq.heappush(self.waiting, (done_s, idx, start_s, k))

    def flush(self, now_s: float, prompt_tokens: Sequence[int]) -> None:
        """Start every transfer whose prefill is done by `now_s` (no later arrival can precede it)."""
        while self.waiting and self.waiting[0][0] <= now_s:
            done, idx, start, k = heapq.heappop(self.waiting)
            self.decode[k].add_join(self.send(start, done, prompt_tokens[idx], k), idx)


def run_margin_routed(arrivals_s: Sequence[float], order: Sequence[int], prompt_tokens: Sequence[int],
                      output_tokens: Sequence[int], cached_tokens: Sequence[int], shape: RoutedShape,
                      prefill_model: LatencyModel, decode_model: LatencyModel, decide: Decide) -> RoutedRun:
    """Route and simulate the requests `order` names (sorted by arrival), module contract."""
    n = len(arrivals_s)
    limits = ColocatedLimits(shape.chunk_tokens, shape.max_seqs, decode_model.kv_capacity_tokens)
    decode = [MixedInstance(prompt_tokens, output_tokens, cached_tokens, decode_model, limits)
              for _ in range(shape.decode_replicas)]
    prefill, links = _PrefillPool(prefill_model, shape.prefill_replicas), _Links(shape.link, decode_model.kv_bytes_per_token, decode)
    first, finish, remote, views = [0.0] * n, [0.0] * n, [False] * n, []
    routed = [0] * len(decode)
    done_at_p: list[list[float]] = [[] for _ in decode]  # one-token requests: they finish at P
    for num, i in enumerate(order):
        now, k = arrivals_s[i], num % len(decode)
        links.flush(now, prompt_tokens)
        d = decode[k]
        d.advance(now)
        finished = len(d.result.finish_s) + sum(1 for t in done_at_p[k] if t <= now)
        view = ArrivalView(i, now, prompt_tokens[i], cached_tokens[i], output_tokens[i], d.batch.size,
                           routed[k] - finished, d.pending_prompt_tokens(), prefill.pending_tokens(now))
        views.append(view)
        routed[k] += 1
        if not decide(view):
            d.add_prompt(i)
            continue
        remote[i] = True
        start, first[i] = prefill.run(now, prompt_tokens[i] - cached_tokens[i], cached_tokens[i])
        if output_tokens[i] > 1:
            links.push(first[i], i, start, k)
        else:
            finish[i] = first[i]
            done_at_p[k].append(first[i])
    links.flush(float("inf"), prompt_tokens)
    for d in decode:
        run = d.drain()
        for i, t in run.first_token_s.items():
            first[i] = t
        for i, t in run.finish_s.items():
            finish[i] = t
    return RoutedRun(first, finish, remote, tuple(views), sum(d.result.num_preempted for d in decode),
                     links.mean_exposed_s)
