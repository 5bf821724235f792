"""One colocated instance: chunked prefill mixed into continuous decode under a token budget.

Contract (Sarathi-style, as engine/scheduler.py): each iteration runs one decode row for every
running sequence plus prefill rows from the FCFS pending queue up to `chunk_tokens - batch
size`. Prompts are cut at multiples of `chunk_tokens` (counting prefix-cached tokens), as the
engine cuts them: the iteration's first chunk runs whole even past the budget left by decode
rows; a later one runs only if it fits whole (a started prompt that does not fit waits, and no
new prompt starts behind the first one that cannot). A prompt may span several iterations. A
request's first token appears at the end of the iteration that finishes its prompt, and it
joins the decode batch for the next iteration. Starting a prompt reserves its
K/V (prompt tokens) in the pool; a prompt starts only if the pool keeps room for one more step
and the instance has fewer than `max_seqs` sequences. When decode growth overflows the pool the
newest decode member is preempted back to the front of the queue, to recompute prompt +
generated - 1 rows. With no prefill to run, the batch advances by whole segments.

Driven incrementally (`MixedInstance`: `add_prompt`, `advance`, `drain`), the same iterations
serve a decode worker that also prefills locally (sim/margin_routed.py): decode-only requests
whose K/V arrives from a prefill worker join the batch at the first step boundary at or after
their ready time, FCFS, when it has a free slot and the pool keeps room for one more step (as
decode_pool.py admits), and decode segments stop at `until_s` and at the next join. `run`, the
batch simulation, is unchanged by this and uses none of it.

`mixed=False` is the prefill-first scheduler without mixing (vLLM 0.2's, DistServe's colocated
baseline): waiting prompts run whole (not cut into chunks), up to `chunk_tokens` tokens (the first
one even past it), in an iteration of their own while the whole decode batch waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from pdserve.sim.batch import DecodeBatch, segment_s, steps_until
from pdserve.latency.base import LatencyModel


@dataclass(frozen=True)
class ColocatedLimits:
    """Per-iteration token budget and admission limits of one colocated instance."""

    chunk_tokens: int = 512
    max_seqs: int = 256
    capacity_tokens: int | None = None
    mixed: bool = True  # False: prefill-only iterations while decodes wait (module contract)

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.max_seqs < 1:
            raise ValueError("chunk budget and max sequences must be >= 1")


@dataclass
class ColocatedRun:
    """Mutable per-instance results."""

    first_token_s: dict[int, float]
    finish_s: dict[int, float]
    num_preempted: int = 0


class MixedInstance:
    """State of one simulated instance; `run` drives it to completion over known arrivals, or
    `add_prompt` / `advance` / `drain` step it as a caller's events arrive (module contract)."""

    def __init__(self, prompt, output, cached, model: LatencyModel, limits: ColocatedLimits) -> None:
        self.prompt, self.output, self.cached, self.model, self.limits = prompt, output, cached, model, limits
        self.cap = float("inf") if limits.capacity_tokens is None else limits.capacity_tokens
        self.batch = DecodeBatch()
        self.pending: deque[list] = deque()  # [idx, rows to compute (>= 1), rows done, generated, reserved]
        self.started = 0  # pending entries holding a reservation (entry[4] > 0)
        self.reserved = 0
        self.result = ColocatedRun({}, {})
        self.t = 0.0
        self.joins: deque[tuple[float, int]] = deque()  # (K/V ready time, idx) of decode-only requests, sorted

    def add_prompt(self, idx: int) -> None:
        """Request `idx` arrives now (at or before `t`): its prompt queues FCFS."""
        self.pending.append([idx, self.prompt[idx] - self.cached[idx], 0, 0, 0])

    def add_join(self, ready_s: float, idx: int) -> None:
        """Request `idx`'s prompt and first token are ready here at `ready_s` (not before the last join's)."""
        self.joins.append((ready_s, idx))

    def pending_prompt_tokens(self) -> int:
        """Prompt rows queued or part-way (what an engine reports as its pending prompt tokens)."""
        return sum(e[1] - e[2] for e in self.pending)

    def advance(self, until_s: float) -> None:
        """Run iterations while the clock is before `until_s`; an iteration is atomic, so the last
        may end past it, and a decode segment ends at the first step boundary at or after it."""
        while self.t < until_s:
            self._admit_joins()
            self._preempt_overflow()
            if self.pending and self._mixed_iteration():
                continue
            upcoming = self.joins[0][0] if self.joins and self.joins[0][0] > self.t else None
            if self.batch.size == 0:
                if self.pending:
                    raise ValueError(f"request {self.pending[0][0]} cannot fit an empty instance")
                if not self.joins:
                    self.t = self.t if until_s == float("inf") else until_s  # idle until the caller's event
                    return
                self.t = min(until_s, self.joins[0][0])
                continue
            bound = until_s if upcoming is None else min(until_s, upcoming)
            self._decode_segment(None if bound == float("inf") else bound)

    def drain(self) -> ColocatedRun:
        """Run until every queued prompt, join and decode has finished."""
        self.advance(float("inf"))
        return self.result

    def _admit_joins(self) -> None:
        """Ready decode-only requests join FCFS while a slot and the pool's room allow."""
        batch, joins = self.batch, self.joins
        while joins and joins[0][0] <= self.t:
            idx = joins[0][1]
            context = self.prompt[idx] + 1
            if batch.size + self.started >= self.limits.max_seqs or ((batch.size or self.reserved) and context > self._room()):
                return
            joins.popleft()
            batch.add(idx, context, 1, self.output[idx] - 1)

    def run(self, arrivals_s: Sequence[float], idxs: Sequence[int]) -> ColocatedRun:
        j, n = 0, len(idxs)
        while True:
            while j < n and arrivals_s[j] <= self.t:
                i = idxs[j]
                self.pending.append([i, self.prompt[i] - self.cached[i], 0, 0, 0])
                j += 1
            self._preempt_overflow()
            if self.pending and self._mixed_iteration():
                continue
            if self.batch.size == 0:
                if self.pending:
                    raise ValueError(f"request {self.pending[0][0]} cannot fit an empty colocated instance")
                if j == n:
                    return self.result
                self.t = arrivals_s[j]
                continue
            next_arrival = arrivals_s[j] if j < n and not self.pending else None
            self._decode_segment(next_arrival)

    def _preempt_overflow(self) -> None:
        batch = self.batch
        while batch.context_sum + self.reserved > self.cap and batch.size > 1:
            idx, generated = batch.preempt_newest()
            self.pending.appendleft([idx, self.prompt[idx] + generated - 1, 0, generated, 0])
            self.result.num_preempted += 1

    def _mixed_iteration(self) -> bool:
        """Run one iteration with prefill rows; False when no prefill row can run now."""
        chunk, mixed = self.limits.chunk_tokens, self.limits.mixed
        budget = chunk - self.batch.size if mixed else chunk
        rows = pairs = kv = 0
        fraction = 0.0
        first = True
        touched = []  # only an entry that ran rows this iteration can finish its prompt
        cached = self.cached
        for entry in self.pending:
            if budget <= 0 and not first:
                break
            visible = entry[2] + (cached[entry[0]] if entry[3] == 0 else 0)
            take = entry[1] - entry[2]
            if mixed:
                take = min(take, chunk - visible % chunk)  # up to the next chunk boundary
            if take > budget and not first:
                if entry[4]:
                    continue  # a started prompt waits for a step with room for its whole chunk
                break  # FCFS: nothing starts ahead of the first prompt that cannot
            if not entry[4] and not self._reserve(entry):
                break
            rows, budget, first = rows + take, budget - take, False
            pairs += take * visible + take * (take + 1) // 2
            kv += visible + 2 * take
            fraction += take / entry[1]
            entry[2] += take
            touched.append(entry)
        if rows == 0:
            return False
        batch = self.batch
        if not mixed:  # a prefill-only iteration: the decode batch waits
            self.t += self.model.mixed_step_s(rows, pairs, kv, fraction, 0, 0)
            self._promote_finished_prompts(touched)
            return True
        self.t += self.model.mixed_step_s(rows, pairs, kv, fraction, batch.size, batch.context_sum)
        if batch.size:
            batch.advance(1)
            for idx in batch.pop_finished():
                self.result.finish_s[idx] = self.t
        self._promote_finished_prompts(touched)
        return True

    def _reserve(self, entry: list) -> bool:
        need = self.prompt[entry[0]] + max(entry[3], 1)
        if (self.batch.size or self.reserved) and need > self._room():
            return False
        if self.batch.size + self.started >= self.limits.max_seqs:
            return False
        entry[4] = need
        self.reserved += need
        self.started += 1
        return True

    def _room(self) -> int | float:
        """K/V tokens a new sequence may take: the pool less the batch, reservations and one more step."""
        return self.cap - self.batch.context_sum - self.reserved - self.batch.size - 1

    def _promote_finished_prompts(self, touched: list[list]) -> None:
        """Prompts whose last row ran this iteration (`touched`, in queue order) emit their first
        token and start decoding."""
        done = [e for e in touched if e[2] >= e[1]]
        if not done:
            return
        pending = self.pending
        left = len(done)
        while left and pending[0][2] >= pending[0][1]:  # the usual case: they lead the queue
            pending.popleft()
            left -= 1
        if left:  # one behind a started prompt that waited
            self.pending = deque(e for e in pending if e[2] < e[1])
        self.started -= len(done)
        for idx, _, _, generated, reserved in done:
            self.reserved -= reserved
            if generated == 0:
                self.result.first_token_s[idx] = self.t
                generated = 1
            if generated >= self.output[idx]:
                self.result.finish_s[idx] = self.t
            else:
                self.batch.add(idx, self.prompt[idx] + generated, generated, self.output[idx] - generated)

    def _decode_segment(self, next_arrival_s: float | None) -> None:
        batch, segment = self.batch, self.model.decode_segment_s
        size, ctx = batch.size, batch.context_sum
        d0, d1 = segment(size, ctx)
        k = batch.steps_to_next_finish()
        if self.cap != float("inf"):
            k = min(k, max(1, int((self.cap - ctx - self.reserved) // size) + 1))
        if next_arrival_s is not None:
            k = min(k, steps_until(d0, d1, next_arrival_s - self.t))
        self.t += segment_s(d0, d1, k)
        batch.advance(k)
        for idx in batch.pop_finished():
            self.result.finish_s[idx] = self.t


def run_colocated_instance(
    arrivals_s: Sequence[float],
    idxs: Sequence[int],
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    cached_tokens: Sequence[int],
    model: LatencyModel,
    limits: ColocatedLimits,
) -> ColocatedRun:
    """Simulate one instance; request `idxs[j]` arrives at `arrivals_s[j]` (sorted)."""
    return MixedInstance(prompt_tokens, output_tokens, cached_tokens, model, limits).run(arrivals_s, idxs)
