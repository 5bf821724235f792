"""When to start a dead worker again: bounded exponential backoff, one new epoch per start.

Contract: `RestartSchedule` is pure (the caller passes the clock). `on_death(worker, now)` is
called once per death and returns when the worker may start again; `due(now)` lists the workers
whose time came, each with the epoch to start it under (one above the epoch that died, so the
router's registry fences every message of the dead incarnation); `on_started(worker, epoch, now)`
records the start. Delays double from `first_delay_s` up to `max_delay_s`; a worker that stayed
up `reset_after_s` starts again from `first_delay_s`. With `enabled=False` nothing is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    enabled: bool = True
    first_delay_s: float = 0.5
    max_delay_s: float = 8.0
    reset_after_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError(f"restart delays must satisfy 0 < first ({self.first_delay_s}) <= max ({self.max_delay_s})")


@dataclass
class _Life:
    epoch: int
    started_s: float
    delay_s: float
    due_s: float | None = None  # set while dead and waiting for its restart


@dataclass
class RestartSchedule:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    lives: dict[str, _Life] = field(default_factory=dict)
    num_restarts: int = 0

    def on_started(self, worker_id: str, epoch: int, now: float) -> None:
        life = self.lives.get(worker_id)
        delay = self.policy.first_delay_s if life is None else life.delay_s
        self.lives[worker_id] = _Life(epoch, now, delay)

    def on_death(self, worker_id: str, now: float) -> float | None:
        """The time the worker may start again, or None when restarts are off."""
        life = self.lives.get(worker_id) or _Life(1, now, self.policy.first_delay_s)
        if not self.policy.enabled:
            self.lives[worker_id] = life
            return None
        if life.due_s is not None:
            raise ValueError(f"{worker_id}: death reported twice")
        if now - life.started_s >= self.policy.reset_after_s:
            life.delay_s = self.policy.first_delay_s
        life.due_s = now + life.delay_s
        life.delay_s = min(2 * life.delay_s, self.policy.max_delay_s)
        self.lives[worker_id] = life
        return life.due_s

    def due(self, now: float) -> list[tuple[str, int]]:
        """(worker id, epoch to start it under) for every dead worker whose backoff elapsed."""
        return [(wid, life.epoch + 1) for wid, life in sorted(self.lives.items())
                if life.due_s is not None and life.due_s <= now]

    def mark_restarted(self, worker_id: str, epoch: int, now: float) -> None:
        life = self.lives[worker_id]
        if life.due_s is None or epoch != life.epoch + 1:
            raise ValueError(f"{worker_id}: restart under epoch {epoch} was not scheduled")
        life.epoch, life.started_s, life.due_s = epoch, now, None
        self.num_restarts += 1

    def note_epoch(self, worker_id: str, epoch: int) -> None:
        """A live worker moved to a newer epoch (a role change): its next restart goes above it."""
        life = self.lives.get(worker_id)
        if life is not None and epoch > life.epoch:
            life.epoch = epoch

    def waiting(self) -> list[str]:
        return sorted(wid for wid, life in self.lives.items() if life.due_s is not None)
