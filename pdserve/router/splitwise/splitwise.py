"""Splitwise's pool controller: move workers between the prompt and the token pool as load shifts.

Contract: `PoolController.observe(signals, now)` is pure (no I/O): it reads the two pools' queue
signals and returns at most one `Move` (a worker and its new role), which the router process
carries out with the one role-change mechanism (router/process/role_control.py: drain, new epoch,
register again). The signals, per pool, from the workers' load reports:

    prompt pressure   seconds of prompt work queued per prefill worker: the cost model's
                      queue_s(pending prompt tokens) summed over the prompt pool and the decode
                      workers' queued local prefills (prompt work too), per prefill worker
    token pressure    the token pool's busiest worker: the larger of its K/V in use (1 - free
                      blocks / blocks) and its measured TPOT's share of the TPOT objective (the
                      mean TPOT its live requests see / TPOT target)

Hysteresis: a pool counts as pressed only after `hold` consecutive observations over its high
mark while the other pool stays under its low mark; after a move nothing moves for `cooldown_s`
(the moved worker drains and registers again meanwhile); the token pool keeps at least one
worker, and so does the prompt pool unless `prompt_pool_may_empty` (the decode workers prefill
locally: the router then runs whole requests on them, router.Router.snapshot), which lets the
last prompt worker go to a decode-heavy phase, Splitwise's mixed pool on two machines.
The worker moved is the other pool's least loaded. The controller only ever moves workers
between `prefill` and `decode`; `mixed` workers stay mixed, and each observation also latches the
two pressures (same marks, same `hold`) into `offer`, the pools the mixed workers serve now
(router/splitwise/mixed_pool.py).

A move is first a loan (`kind` "lend"): the worker keeps its origin role, and once the pool that
borrowed it has been calm (under its low mark) for `hold` observations it goes back ("return").
A loan still needed after `adopt_after_s` is a lasting shift: the worker's origin becomes its
new role ("change"; nothing moves, the loan is simply no longer returned).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.splitwise.mixed_pool import MixedLatches, MixedOffer, PressureLatch


@dataclass(frozen=True)
class PoolSignals:
    """One observation: per worker (id -> value) of each pool."""

    prompt_queue_s: dict[str, float]  # prefill workers: seconds of queued prompt work
    kv_used: dict[str, float]  # decode workers: fraction of K/V blocks in use
    tpot_used: dict[str, float] = field(default_factory=dict)  # decode workers: measured TPOT / TPOT target
    local_prompt_s: dict[str, float] = field(default_factory=dict)  # decode workers: queued local prefill seconds


@dataclass(frozen=True)
class Move:
    worker_id: str
    to_role: str
    reason: str
    kind: str = "lend"  # "lend" | "return" | "change" (a loan adopted: no worker moves)


@dataclass(frozen=True)
class Thresholds:
    prompt_high_s: float = 2.0  # mean queued prompt seconds per prefill worker that counts as pressed
    prompt_low_s: float = 0.5
    kv_high: float = 0.8  # the busiest decode worker's K/V in use that counts as pressed
    kv_low: float = 0.5
    hold: int = 3  # consecutive pressed observations before a move
    cooldown_s: float = 10.0
    adopt_after_s: float = 120.0  # a loan still needed this long becomes a role change

    def __post_init__(self) -> None:
        if not (0 <= self.prompt_low_s < self.prompt_high_s and 0 <= self.kv_low < self.kv_high <= 1 and self.hold >= 1):
            raise ValueError("splitwise thresholds need low < high marks and hold >= 1")


@dataclass
class PoolController:
    thresholds: Thresholds = field(default_factory=Thresholds)
    prompt_pool_may_empty: bool = False  # decode workers take local prefills (pd decision not "always")
    prompt_streak: int = 0
    token_streak: int = 0
    quiet_until_s: float = 0.0
    calm_streak: dict[str, int] = field(default_factory=dict)  # per borrowing role
    loans: dict[str, tuple[str, float]] = field(default_factory=dict)  # worker -> (origin role, since)
    moves: list[Move] = field(default_factory=list)
    offer: MixedOffer = field(default_factory=MixedOffer)  # where mixed workers serve (mixed_pool.py)

    def __post_init__(self) -> None:
        t = self.thresholds
        self.latches = MixedLatches(PressureLatch(t.prompt_high_s, t.prompt_low_s, t.hold), PressureLatch(t.kv_high, t.kv_low, t.hold))

    def observe(self, signals: PoolSignals, now_s: float) -> Move | None:
        t = self.thresholds
        prompt = _prompt_pressure(signals)
        kv = max((max(used, signals.tpot_used.get(w, 0.0)) for w, used in signals.kv_used.items()), default=0.0)
        self.offer = self.latches.observe(prompt, kv)
        self.prompt_streak = self.prompt_streak + 1 if prompt > t.prompt_high_s and kv < t.kv_low else 0
        self.token_streak = self.token_streak + 1 if kv > t.kv_high and prompt < t.prompt_low_s else 0
        self.calm_streak = {"prefill": self.calm_streak.get("prefill", 0) + 1 if prompt < t.prompt_low_s else 0,
                            "decode": self.calm_streak.get("decode", 0) + 1 if kv < t.kv_low else 0}
        if now_s < self.quiet_until_s:
            return None
        move = self._settle_loans(now_s) or self._lend(signals, prompt, kv)
        if move is not None:
            if move.kind != "change":
                self.prompt_streak = self.token_streak = 0
                self.quiet_until_s = now_s + t.cooldown_s
            self._book(move, now_s)
            self.moves.append(move)
        return move

    def _settle_loans(self, now_s: float) -> Move | None:
        """The oldest loan that is over (its borrowing pool calm) or has become a lasting shift."""
        t = self.thresholds
        for worker, (origin, since) in sorted(self.loans.items(), key=lambda kv: kv[1][1]):
            borrowed_as = "decode" if origin == "prefill" else "prefill"
            if self.calm_streak.get(borrowed_as, 0) >= t.hold:
                return Move(worker, origin, f"{borrowed_as} pool calm for {t.hold} observations", "return")
            if now_s - since >= t.adopt_after_s:
                return Move(worker, borrowed_as, f"lent for {now_s - since:.0f}s: a lasting shift", "change")
        return None

    def _book(self, move: Move, now_s: float) -> None:
        if move.kind == "lend":
            origin = "decode" if move.to_role == "prefill" else "prefill"
            self.loans[move.worker_id] = (origin, now_s)
        else:
            self.loans.pop(move.worker_id, None)

    def _lend(self, signals: PoolSignals, prompt: float, kv: float) -> Move | None:
        t = self.thresholds
        move = None
        if self.prompt_streak >= t.hold and len(signals.kv_used) > 1:
            worker = min(signals.kv_used, key=lambda w: (signals.kv_used[w], w))
            move = Move(worker, "prefill", f"prompt queue {prompt:.2f}s per worker, K/V in use {kv:.0%}")
        elif self.token_streak >= t.hold and len(signals.prompt_queue_s) > (0 if self.prompt_pool_may_empty else 1):
            worker = min(signals.prompt_queue_s, key=lambda w: (signals.prompt_queue_s[w], w))
            move = Move(worker, "decode", f"token pool at {kv:.0%} (K/V or TPOT), prompt queue {prompt:.2f}s per worker")
        return move


def _prompt_pressure(signals: PoolSignals) -> float:
    """Queued prompt seconds, the prompt pool's and the decode workers' local prefills, per
    prefill worker (all of it on one when the prompt pool is empty)."""
    queued = sum(signals.prompt_queue_s.values()) + sum(signals.local_prompt_s.values())
    return queued / max(1, len(signals.prompt_queue_s))
