"""Splitwise's pool controller: move workers between the prompt and the token pool as load shifts.

Contract: `PoolController.observe(signals, now)` is pure (no I/O): it reads the two pools' queue
signals and returns at most one `Move` (a worker and its new role), which the router process
carries out with the one role-change mechanism (router/role_control.py: drain, new epoch,
register again). The signals, per pool, from the workers' load reports:

    prompt pressure   seconds of prompt work queued per prefill worker: the cost model's
                      queue_s(pending prompt tokens) averaged over the prompt pool
    token pressure    the token pool's K/V in use (1 - free blocks / blocks), its busiest worker

Hysteresis: a pool counts as pressed only after `hold` consecutive observations over its high
mark while the other pool stays under its low mark; after a move nothing moves for `cooldown_s`
(the moved worker drains and registers again meanwhile); each pool keeps at least one worker.
The worker moved is the other pool's least loaded. The controller only ever moves workers
between `prefill` and `decode`; the roles they started in are kept by the router (`origin`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolSignals:
    """One observation: per worker (id -> value) of each pool."""

    prompt_queue_s: dict[str, float]  # prefill workers: seconds of queued prompt work
    kv_used: dict[str, float]  # decode workers: fraction of K/V blocks in use


@dataclass(frozen=True)
class Move:
    worker_id: str
    to_role: str
    reason: str


@dataclass(frozen=True)
class Thresholds:
    prompt_high_s: float = 2.0  # mean queued prompt seconds per prefill worker that counts as pressed
    prompt_low_s: float = 0.5
    kv_high: float = 0.8  # the busiest decode worker's K/V in use that counts as pressed
    kv_low: float = 0.5
    hold: int = 3  # consecutive pressed observations before a move
    cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        if not (0 <= self.prompt_low_s < self.prompt_high_s and 0 <= self.kv_low < self.kv_high <= 1 and self.hold >= 1):
            raise ValueError("splitwise thresholds need low < high marks and hold >= 1")


@dataclass
class PoolController:
    thresholds: Thresholds = field(default_factory=Thresholds)
    prompt_streak: int = 0
    token_streak: int = 0
    quiet_until_s: float = 0.0
    moves: list[Move] = field(default_factory=list)

    def observe(self, signals: PoolSignals, now_s: float) -> Move | None:
        t = self.thresholds
        prompt = _mean(signals.prompt_queue_s.values())
        kv = max(signals.kv_used.values(), default=0.0)
        self.prompt_streak = self.prompt_streak + 1 if prompt > t.prompt_high_s and kv < t.kv_low else 0
        self.token_streak = self.token_streak + 1 if kv > t.kv_high and prompt < t.prompt_low_s else 0
        if now_s < self.quiet_until_s:
            return None
        move = None
        if self.prompt_streak >= t.hold and len(signals.kv_used) > 1:
            worker = min(signals.kv_used, key=lambda w: (signals.kv_used[w], w))
            move = Move(worker, "prefill", f"prompt queue {prompt:.2f}s per worker, K/V in use {kv:.0%}")
        elif self.token_streak >= t.hold and len(signals.prompt_queue_s) > 1:
            worker = min(signals.prompt_queue_s, key=lambda w: (signals.prompt_queue_s[w], w))
            move = Move(worker, "decode", f"K/V in use {kv:.0%}, prompt queue {prompt:.2f}s per worker")
        if move is not None:
            self.prompt_streak = self.token_streak = 0
            self.quiet_until_s = now_s + t.cooldown_s
            self.moves.append(move)
        return move


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
