"""Splitwise's mixed-machine prompt priority: a waiting prompt may displace young token work.

Contract. A worker that runs both phases (a splitwise decode worker taking local prefills, a
colocated worker) normally gives decode rows every step and admits prompts only into free batch
slots (scheduler.py). With prompt priority on, a *fresh* prompt at the head of the queue (no
output yet, never preempted, not imported) that finds every batch slot (`max_num_seqs`) taken
may preempt one decoding sequence, chosen by the ledger's `choose_mixed_phase` (one copy of the
rule, ledger/splitwise.py): only a token request younger than `age_override_ms` at this worker
and preempted fewer than `max_preemptions` times can be displaced; the youngest such one is.
At most one displacement per engine step, so a burst of prompts cannot empty the decode batch in
one step, and the displaced sequence queues right behind the prompt that displaced it.

The displaced sequence keeps its capacity: the blocks its release frees go back to it as a
reservation, so a prompt-priority preemption never moves K/V capacity between requests (the
router's hold for it stays true) and its recompute is never starved of blocks. Like any preempted
sequence it recomputes its K/V by prefill: the prompt's bits come out as before (same aligned
chunks), the generated positions' K/V are summed by the prefill kernel instead of the decode one,
so its continuation equals the uninterrupted stream except where a near-tie flips (bf16 on a
random model; tests/engine/test_prompt_priority.py checks equality in fp32).

Pure over the scheduler's lists; the only input from outside is the clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence, SeqMode
from pdserve.ledger.splitwise import choose_mixed_phase


@dataclass(frozen=True)
class PromptPriority:
    age_override_ms: float = 1000.0  # token work at least this old at the worker is never displaced
    max_preemptions: int = 1  # a token request preempted this often is never displaced again

    def __post_init__(self) -> None:
        if self.age_override_ms < 0 or self.max_preemptions < 0:
            raise ValueError("prompt priority needs age_override_ms >= 0 and max_preemptions >= 0")


def is_fresh_prompt(seq: Sequence) -> bool:
    """Prompt work in the Splitwise sense: nothing generated, never preempted, K/V not imported."""
    return not seq.output_ids and seq.num_preemptions == 0 and seq.mode is SeqMode.NORMAL


def pick_displaced(
    running: Iterable[Sequence], policy: PromptPriority, now_s: float, prompt_pending: bool
) -> Sequence | None:
    """The decoding sequence a pending prompt may displace now, or None (the youngest that the
    ledger's rule gives up to the prompt)."""
    eligible = [
        s for s in running
        if s.is_decoding and s.mode is not SeqMode.PREFILL_ONLY
        and choose_mixed_phase(prompt_pending, (now_s - s.queued_s) * 1e3, s.num_preemptions,
                               policy.age_override_ms, policy.max_preemptions) == "prompt"
    ]
    return max(eligible, key=lambda s: (s.queued_s, s.arrival)) if eligible else None
