"""Iteration-level scheduler with chunked prefill (decode rows first, prefill chunks fill the rest).

Contract, per `schedule()` call:
1. Every decoding sequence gets one row, oldest first. If its next slot needs a block that is
   not available, the newest other running sequence is preempted (blocks freed, K/V recomputed
   later); if there is none, the sequence itself is preempted. Decode never waits on prefill.
2. The remaining token budget goes to prefill chunks: sequences already prefilling first, then
   waiting sequences in arrival order. Chunks end on multiples of the chunk size (the budget), so
   a prompt is split at the same positions in every step mix and on every worker role: its K/V
   bits do not depend on its batch mates. Admission looks up the prefix cache; a chunk is trimmed
   only when blocks run short, and admission stops (FCFS) at the first sequence that cannot start.
   A request that asks for prompt logprobs takes no prefix hit until its prompt is scored: the
   logits of cached positions were never kept.
3. Nothing here touches tensors; the runner turns the plan into a batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.prefill_buckets import length_bucket, next_admission
from pdserve.engine.prompt_priority import PromptPriority, is_fresh_prompt, pick_displaced
from pdserve.engine.sequence import Sequence, SeqMode, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    prompt_priority: PromptPriority | None = None  # Splitwise mixed-machine rule (prompt_priority.py); None = off
    prefill_length_buckets: tuple[int, ...] = ()  # admissions after a step's first follow its length bucket


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, rows this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.blocks = blocks
        self.config = config
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start, every cause
        self.num_priority_preemptions = 0  # of which a waiting prompt displaced token work
        self._cached_when_queued: dict[str, int] = {}  # request id -> prompt tokens its prefix cache held at add

    def add(self, seq: Sequence) -> None:
        seq.queued_s = self.clock()
        if seq.status is SeqStatus.RUNNING:  # imported: K/V already in place
            self.running.append(seq)
        else:
            self.waiting.append(seq)
            tokens = seq.tokens
            limit = self._prefix_limit(seq, tokens)
            if limit and self.blocks.enable_prefix_cache:  # what admission will find cached is not queued work
                hit = self.blocks.match_prefix(self.blocks.hashes_for(tokens, seq.params.tenant), tokens)
                self._cached_when_queued[seq.request_id] = min(hit, limit) * self.blocks.block_size

    def remove(self, seq: Sequence) -> None:
        """Detach a sequence (finished, aborted or prefilled) and drop its block references."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._cached_when_queued.pop(seq.request_id, None)
        self.release_blocks(seq)

    def release_blocks(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        self.blocks.release_reservation(seq.request_id)
        seq.block_table, seq.block_hashes = [], []

    @property
    def num_pending_prompt_tokens(self) -> int:
        """Prompt tokens still to compute: a waiting sequence's less the prefix its cache held when
        it was queued (the router's queue price, so a queue of follow-up turns whose history is
        cached here is not priced as whole prompts), plus the running prefills' rest."""
        cached = self._cached_when_queued
        return sum(max(0, s.num_uncomputed - cached.get(s.request_id, 0)) for s in self.waiting) + sum(
            s.num_uncomputed for s in self.running if not s.is_decoding
        )

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._prompt_priority(plan)
        budget = self.config.max_num_batched_tokens
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.is_decoding and seq in self.running and len(plan.decode) < self.config.max_num_seqs:
                if self._reserve_decode_slot(seq, plan):
                    plan.decode.append(seq)
                    budget -= 1
        # Prefill chunks end on multiples of the chunk size C (= the token budget), so a prompt is
        # cut at the same places whatever else shares the step. The first chunk of a step may
        # overrun the budget left by decode rows (by at most their number); later chunks run
        # only if they fit whole.
        first = True
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if not seq.is_decoding:
                rows = self._fit_chunk(seq, budget, first)
                if rows:
                    plan.prefill.append((seq, rows))
                    budget, first = budget - rows, False
        bounds = self.config.prefill_length_buckets
        step_bucket = length_bucket(plan.prefill[0][0].num_tokens, bounds) if bounds and plan.prefill else None
        while self.waiting and len(self.running) < self.config.max_num_seqs and (first or budget > 0):
            i = next_admission([w.num_tokens for w in self.waiting], step_bucket, bounds) if bounds else 0
            rows = self._admit(self.waiting[i], budget, first)
            if not rows:
                break
            seq = self.waiting[i]
            del self.waiting[i]
            if bounds and step_bucket is None:
                step_bucket = length_bucket(seq.num_tokens, bounds)
            seq.transition(SeqStatus.RUNNING)
            self.running.append(seq)
            plan.prefill.append((seq, rows))
            budget, first = budget - rows, False
        return plan

    # ---- decode slots and preemption --------------------------------------------------------
    def _prompt_priority(self, plan: StepPlan) -> None:
        """A fresh prompt that finds every batch slot taken displaces one young decode (see
        prompt_priority.py); the displaced sequence keeps its blocks' worth as a reservation and
        waits right behind the prompt."""
        policy = self.config.prompt_priority
        if policy is None or not self.waiting or len(self.running) < self.config.max_num_seqs:
            return
        head = self.waiting[0]
        if not is_fresh_prompt(head):
            return
        victim = pick_displaced(self.running, policy, self.clock(), prompt_pending=True)
        if victim is None:
            return
        kept = self.blocks.reserved.get(victim.request_id, 0)
        free_before = self.blocks.num_free
        self._preempt(victim, plan, behind=head)
        freed = self.blocks.num_free - free_before
        self.blocks.reserve(victim.request_id, min(kept + freed, self.blocks.num_free - self.blocks.num_reserved))
        self.num_priority_preemptions += 1

    def _blocks_needed(self, seq: Sequence, rows: int) -> int:
        bs = self.blocks.block_size
        return max(0, -(-(seq.num_computed + rows) // bs) - len(seq.block_table))

    def _reserve_decode_slot(self, seq: Sequence, plan: StepPlan) -> bool:
        need = self._blocks_needed(seq, 1)
        while need and not self.blocks.can_allocate(need, owner=seq.request_id):
            victim = self._pick_victim(exclude=[seq, *plan.decode])
            if victim is None:
                self._preempt(seq, plan)
                return False
            self._preempt(victim, plan)
        if need:
            seq.block_table += self.blocks.allocate(need, owner=seq.request_id)
        return True

    def _pick_victim(self, exclude: list[Sequence]) -> Sequence | None:
        """The newest running sequence, never a prefill-only one: its finished chunks may already
        be streaming to a decode worker from the blocks it holds (see handoff/gate.py)."""
        candidates = [s for s in self.running if s not in exclude and s.mode is not SeqMode.PREFILL_ONLY]
        return max(candidates, key=lambda s: s.arrival) if candidates else None

    def _preempt(self, seq: Sequence, plan: StepPlan, behind: Sequence | None = None) -> None:
        self.running.remove(seq)
        self.release_blocks(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.mode is SeqMode.IMPORTED:
            seq.mode = SeqMode.NORMAL  # its K/V is recomputed here from now on
        seq.transition(SeqStatus.WAITING)
        plan.preempted.append(seq)
        if behind is not None:  # displaced by a prompt: it waits right behind that prompt
            self.waiting.insert(self.waiting.index(behind) + 1, seq)
            return
        # keep FCFS: a preempted sequence goes back ahead of anything that arrived after it
        index = next((i for i, w in enumerate(self.waiting) if w.arrival > seq.arrival), len(self.waiting))
        self.waiting.insert(index, seq)

    # ---- prefill chunks ---------------------------------------------------------------------
    def _aligned_rows(self, seq: Sequence) -> int:
        """A prompt's next chunk ends on the chunk grid and never past the prompt; a recompute's
        output positions follow as replay rows (engine/runner.py), up to a chunk's worth a step."""
        chunk = self.config.max_num_batched_tokens
        prompt = len(seq.prompt_ids)
        if seq.num_computed >= prompt:
            return min(seq.num_uncomputed, chunk)
        return min(prompt - seq.num_computed, chunk - seq.num_computed % chunk)

    def _fit_chunk(self, seq: Sequence, budget: int, first: bool) -> int:
        """Rows of `seq` to prefill now (its next aligned chunk, whole); allocates the blocks."""
        rows = self._aligned_rows(seq)
        if rows > budget and not first:
            return 0
        avail = self.blocks.available_for(seq.request_id)
        bs = self.blocks.block_size
        rows = min(rows, (len(seq.block_table) + avail) * bs - seq.num_computed)  # only under memory pressure
        if rows <= 0:
            return 0
        seq.block_table += self.blocks.allocate(self._blocks_needed(seq, rows), owner=seq.request_id)
        return rows

    def _prefix_limit(self, seq: Sequence, tokens: list[int]) -> int:
        """Leading blocks a sequence may take from the prefix cache: all but the one holding its last
        row (at least one row is computed, for the logits); none while prompt logprobs are owed (a
        cached block has no logits: positions still to be scored are computed)."""
        return 0 if needs_prompt_logits(seq) else (len(tokens) - 1) // self.blocks.block_size

    def _admit(self, seq: Sequence, budget: int, first: bool) -> int:
        """Look up the prefix cache for a waiting sequence, then fit its first chunk."""
        tokens = seq.tokens
        hashes = self.blocks.hashes_for(tokens, seq.params.tenant)
        hit_blocks = self.blocks.acquire_prefix(hashes, tokens, self._prefix_limit(seq, tokens), owner=seq.request_id)
        seq.block_table = hit_blocks
        seq.block_hashes = hashes[: len(hit_blocks)]
        seq.num_computed = len(hit_blocks) * self.blocks.block_size
        if seq.num_preemptions == 0 and seq.mode is not SeqMode.IMPORTED:
            seq.num_cached_tokens = seq.num_computed
        rows = self._fit_chunk(seq, budget, first)
        if rows == 0:
            self.release_blocks(seq)
            seq.num_computed = 0
        return rows


def needs_prompt_logits(seq: Sequence) -> bool:
    """The request wants prompt logprobs, some prompt position is not scored yet, and no output
    token exists: they travel with the first one, so a sequence that already has outputs (a
    recompute after preemption or a fallback, a decode worker's import) never scores again."""
    return (seq.params.prompt_logprobs is not None and not seq.output_ids
            and len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1)
