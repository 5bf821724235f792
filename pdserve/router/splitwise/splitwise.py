"""Splitwise's pool controller: lend workers between the prompt and the token pool as load shifts.

Contract: `PoolController.observe(signals, now)` is pure (no I/O): it reads the two pools' queue
signals and returns at most one `Move`, which the router process carries out without waiting on
it (router/process/role_control.py's `apply_move`). A move is one of three kinds, the spec's
TOKEN(e) -> MIXED(origin=TOKEN) -> TOKEN, and the coarse repurposing beside it:

    lend      the worker enters the mixed state: it keeps its role, its epoch and everything it
              runs, and serves the other pool (`to_role`) as well (Router.lend; nothing drains)
    return    the pool that borrowed it has been calm (under its low mark) for `hold`
              observations: it stops taking the borrowed phase (`to_role` is its own role); what
              it runs of that phase finishes there
    change    a loan still needed after `adopt_after_s` is a lasting shift: the worker's role
              becomes the borrowed one through the one role-change mechanism (drain, new epoch,
              register again): the only move that drains

The signals, per pool, from the LIVE workers' load reports (by their own role; a lent worker's
borrowed work shows in the same reports):

    prompt pressure   seconds of prompt work queued per prompt-pool worker: the cost model's
                      queue_s(pending prompt tokens) summed over the prompt pool and the decode
                      workers' queued prompts (local prefills, and prompt work of a decode worker
                      lent to the prompt pool), per prefill worker or decode worker lent there
    token pressure    the token pool's busiest worker, a decode worker or a prefill worker lent
                      to the pool: the larger of its K/V in use (1 - free blocks / blocks) and its
                      measured TPOT's share of the TPOT objective (the mean TPOT its live requests
                      see / TPOT target)

The prompt pressure counts a lent worker's capacity in its mean; the token pressure is a maximum,
so a worker lent to the token pool counts there twice: its load in the maximum (the pool is not
calm, and its loan not returned, while the lent worker is busy) and its room (below).

Hysteresis: a pool counts as pressed only after `hold` consecutive observations over its high
mark while the other pool stays under its low mark and no guest of the pool has room for its
work (the elastic pool is used before a role's worker is disturbed, and a loan before another:
a mixed worker has room for prompt work while its own queued prompt seconds are under
`prompt_high_s`; a mixed worker, or a prefill worker lent to the token pool, has room for token
work while its own K/V in use and TPOT share are under `kv_high`); after a move nothing moves for
`cooldown_s`.
The worker lent is the other pool's least loaded one not lent already. A worker is lent only out
of a pool it may leave for good (a loan may be adopted): the token pool keeps at least one worker,
and so does the prompt pool unless `prompt_pool_may_empty` (the decode workers prefill locally:
the router then runs whole requests on them, router.Router.snapshot), which lets the last prompt
worker go to a decode-heavy phase, Splitwise's mixed pool on two machines; adoption checks the
same rule again. A loan whose worker is not LIVE (restarting, or draining) waits; one the router
no longer holds (the worker registered again, unlent) is dropped with `forget`.
The controller only ever lends `prefill` and `decode` workers; `mixed` workers stay mixed, and
each observation also latches the two pressures (same marks, same `hold`) into `offer`, the
pools the mixed workers serve now (router/splitwise/mixed_pool.py): a pressed pool is offered its
mixed workers `hold` observations in, and borrows from the other pool only once they are full.
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
    local_prompt_s: dict[str, float] = field(default_factory=dict)  # decode and mixed workers: queued prompt seconds
    mixed_kv_used: dict[str, float] = field(default_factory=dict)  # mixed workers: fraction of K/V blocks in use
    prefill_kv_used: dict[str, float] = field(default_factory=dict)  # prefill workers: the same (counted while lent)


@dataclass(frozen=True)
class Move:
    worker_id: str
    to_role: str
    reason: str
    kind: str = "lend"  # "lend" | "return" | "change" (a loan adopted: the one role change)


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
        prompt = _prompt_pressure(signals, sum(1 for w in self._lent_as("prefill") if w in signals.kv_used))
        kv = max(self._token_pool(signals).values(), default=0.0)
        self.offer = self.latches.observe(prompt, kv)
        self.prompt_streak = (self.prompt_streak + 1 if prompt > t.prompt_high_s and kv < t.kv_low
                              and not self._guest_room("prefill", signals) else 0)
        self.token_streak = (self.token_streak + 1 if kv > t.kv_high and prompt < t.prompt_low_s
                             and not self._guest_room("decode", signals) else 0)
        self.calm_streak = {"prefill": self.calm_streak.get("prefill", 0) + 1 if prompt < t.prompt_low_s else 0,
                            "decode": self.calm_streak.get("decode", 0) + 1 if kv < t.kv_low else 0}
        if now_s < self.quiet_until_s:
            return None
        move = self._settle_loans(signals, now_s) or self._lend(signals, prompt, kv)
        if move is not None:
            self.prompt_streak = self.token_streak = 0
            self.quiet_until_s = now_s + t.cooldown_s
            self._book(move, now_s)
            self.moves.append(move)
        return move

    def forget(self, worker_id: str) -> None:
        """The worker's loan ended outside the controller (it registered again, unlent)."""
        self.loans.pop(worker_id, None)

    def _token_pool(self, signals: PoolSignals) -> dict[str, float]:
        """Each token-pool worker's load, the larger of its K/V in use and its TPOT share: the
        decode workers and the prefill workers lent to the pool (module contract)."""
        used = dict(signals.kv_used)
        used.update((w, signals.prefill_kv_used[w]) for w in self._lent_as("decode") if w in signals.prefill_kv_used)
        return {w: max(u, signals.tpot_used.get(w, 0.0)) for w, u in used.items()}

    def _guest_room(self, pool: str, signals: PoolSignals) -> bool:
        """Some LIVE guest of `pool` is under its high mark on its own, so it takes the pool's work
        before another worker is borrowed (module contract): a mixed worker, or for the token pool
        a prefill worker lent to it."""
        t = self.thresholds
        if pool == "prefill":
            return any(signals.local_prompt_s.get(w, 0.0) < t.prompt_high_s for w in signals.mixed_kv_used)
        lent_in = {w: load for w, load in self._token_pool(signals).items() if w not in signals.kv_used}
        mixed = (max(used, signals.tpot_used.get(w, 0.0)) for w, used in signals.mixed_kv_used.items())
        return any(load < t.kv_high for load in (*lent_in.values(), *mixed))

    def _lent_as(self, role: str) -> list[str]:
        return [w for w, (origin, _) in self.loans.items() if origin != role]

    def _settle_loans(self, signals: PoolSignals, now_s: float) -> Move | None:
        """The oldest loan that is over (its borrowing pool calm) or has become a lasting shift."""
        t = self.thresholds
        for worker, (origin, since) in sorted(self.loans.items(), key=lambda kv: kv[1][1]):
            if worker not in _pool(signals, origin):
                continue  # not LIVE now: settled once it is back
            borrowed_as = "decode" if origin == "prefill" else "prefill"
            if self.calm_streak.get(borrowed_as, 0) >= t.hold:
                return Move(worker, origin, f"{borrowed_as} pool calm for {t.hold} observations", "return")
            if now_s - since >= t.adopt_after_s and self._may_leave(origin, signals):
                return Move(worker, borrowed_as, f"lent for {now_s - since:.0f}s: a lasting shift", "change")
        return None

    def _may_leave(self, origin: str, signals: PoolSignals) -> bool:
        """Whether a worker may leave the `origin` pool for good (module contract)."""
        return len(_pool(signals, origin)) > (0 if origin == "prefill" and self.prompt_pool_may_empty else 1)

    def _book(self, move: Move, now_s: float) -> None:
        if move.kind == "lend":
            origin = "decode" if move.to_role == "prefill" else "prefill"
            self.loans[move.worker_id] = (origin, now_s)
        else:
            self.loans.pop(move.worker_id, None)

    def _lend(self, signals: PoolSignals, prompt: float, kv: float) -> Move | None:
        t = self.thresholds
        if self.prompt_streak >= t.hold and self._may_leave("decode", signals):
            worker = _least_loaded(signals.kv_used, self.loans)
            reason = f"prompt queue {prompt:.2f}s per worker, K/V in use {kv:.0%}"
            return None if worker is None else Move(worker, "prefill", reason)
        if self.token_streak >= t.hold and self._may_leave("prefill", signals):
            worker = _least_loaded(signals.prompt_queue_s, self.loans)
            reason = f"token pool at {kv:.0%} (K/V or TPOT), prompt queue {prompt:.2f}s per worker"
            return None if worker is None else Move(worker, "decode", reason)
        return None


def _pool(signals: PoolSignals, role: str) -> dict[str, float]:
    """The LIVE workers of one dedicated role in the signals."""
    return signals.prompt_queue_s if role == "prefill" else signals.kv_used


def _least_loaded(load: dict[str, float], lent: dict) -> str | None:
    candidates = [w for w in load if w not in lent]
    return min(candidates, key=lambda w: (load[w], w), default=None)


def _prompt_pressure(signals: PoolSignals, num_lent_in: int = 0) -> float:
    """Queued prompt seconds, the prompt pool's and the decode workers' (local prefills, or the
    prompt work of one lent to the prompt pool), per prompt-pool worker (`num_lent_in`: decode
    workers lent there); all of it on one when the prompt pool is empty."""
    queued = sum(signals.prompt_queue_s.values()) + sum(signals.local_prompt_s.values())
    return queued / max(1, len(signals.prompt_queue_s) + num_lent_in)
