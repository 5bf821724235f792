"""When to start a dead worker again: bounded exponential backoff, one new epoch per start, and
a crash-loop limit.

Contract: `RestartSchedule` is pure (the caller passes the clock). `on_death(worker, now)` is
called once per death and returns when the worker may start again (None: restarts are off, or
the worker is FAILED); `due(now)` lists the workers whose time came, each with the epoch to
start it under (one above the epoch that died, so the router's registry fences every message of
the dead incarnation); `on_started(worker, epoch, now)` records the first start and
`mark_restarted` each later one. Delays double from `first_delay_s` up to `max_delay_s`; they
start again from `first_delay_s` only after a death that followed a healthy registration
(`on_registered`) that lasted `reset_after_s` — a worker that crashes after a slow load keeps
its growing delay. `max_crashes` deaths within `crash_window_s` mark the worker FAILED: it is
not started again (`failed()` lists it, the router shows it in /workers and metrics). A restart
sends no heartbeat until it registers, so `unregistered(now)` lists (once) each restarted
incarnation that has not registered `register_timeout_s` after its start: the caller ends it as
hung and its death is then reported like any other. With `enabled=False` nothing is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    enabled: bool = True
    first_delay_s: float = 0.5
    max_delay_s: float = 8.0
    reset_after_s: float = 30.0  # a registration this long counts as healthy: the backoff starts over
    max_crashes: int = 5  # this many deaths within crash_window_s mark the worker FAILED
    crash_window_s: float = 120.0
    register_timeout_s: float = 180.0  # a restart not registered this long after its start is ended (hung loading)

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError(f"restart delays must satisfy 0 < first ({self.first_delay_s}) <= max ({self.max_delay_s})")
        if self.max_crashes < 1 or not self.crash_window_s > 0 or not self.register_timeout_s > 0:
            raise ValueError(f"--max-crashes must be >= 1 and --crash-window-s > 0, got {self.max_crashes}, "
                             f"{self.crash_window_s}")


@dataclass
class _Life:
    epoch: int
    delay_s: float
    registered_s: float | None = None  # when this incarnation registered with the router (healthy)
    due_s: float | None = None  # set while dead and waiting for its restart
    deaths_s: list[float] = field(default_factory=list)  # recent deaths, within the crash window
    failed: bool = False
    started_s: float | None = None  # a restart not registered yet: when it started


@dataclass
class RestartSchedule:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    lives: dict[str, _Life] = field(default_factory=dict)
    num_restarts: int = 0

    def on_started(self, worker_id: str, epoch: int, now: float) -> None:
        life = self.lives.get(worker_id)
        delay = self.policy.first_delay_s if life is None else life.delay_s
        self.lives[worker_id] = _Life(epoch, delay)

    def on_registered(self, worker_id: str, epoch: int, now: float) -> None:
        """The incarnation under `epoch` registered with the router: healthy from `now`."""
        life = self.lives.get(worker_id)
        if life is not None and life.due_s is None and epoch >= life.epoch:
            life.epoch, life.registered_s, life.started_s = epoch, now, None

    def on_death(self, worker_id: str, now: float) -> float | None:
        """The time the worker may start again, or None when restarts are off or it is FAILED."""
        life = self.lives.get(worker_id) or _Life(1, self.policy.first_delay_s)
        self.lives[worker_id] = life
        if not self.policy.enabled or life.failed:
            return None
        if life.due_s is not None:
            raise ValueError(f"{worker_id}: death reported twice")
        if life.registered_s is not None and now - life.registered_s >= self.policy.reset_after_s:
            life.delay_s = self.policy.first_delay_s
        life.registered_s = life.started_s = None
        life.deaths_s = [t for t in life.deaths_s if now - t < self.policy.crash_window_s] + [now]
        if len(life.deaths_s) >= self.policy.max_crashes:
            life.failed = True
            return None
        life.due_s = now + life.delay_s
        life.delay_s = min(2 * life.delay_s, self.policy.max_delay_s)
        return life.due_s

    def due(self, now: float) -> list[tuple[str, int]]:
        """(worker id, epoch to start it under) for every dead worker whose backoff elapsed."""
        return [(wid, life.epoch + 1) for wid, life in sorted(self.lives.items())
                if life.due_s is not None and life.due_s <= now]

    def mark_restarted(self, worker_id: str, epoch: int, now: float) -> None:
        life = self.lives[worker_id]
        if life.due_s is None or epoch != life.epoch + 1:
            raise ValueError(f"{worker_id}: restart under epoch {epoch} was not scheduled")
        life.epoch, life.due_s, life.started_s = epoch, None, now
        self.num_restarts += 1

    def unregistered(self, now: float) -> list[tuple[str, int]]:
        """(worker id, epoch) of each restart not registered `register_timeout_s` after its start;
        each is listed once (the caller ends it, and its death puts it back on the schedule)."""
        stuck = [(wid, life.epoch) for wid, life in sorted(self.lives.items())
                 if life.started_s is not None and now - life.started_s >= self.policy.register_timeout_s]
        for wid, _ in stuck:
            self.lives[wid].started_s = None
        return stuck

    def note_epoch(self, worker_id: str, epoch: int) -> None:
        """A live worker moved to a newer epoch (a role change): its next restart goes above it. A
        dead one's restart keeps the epoch it was scheduled under (the router's message to the dead
        process was never applied, and the supervisor may be starting it under that epoch now)."""
        life = self.lives.get(worker_id)
        if life is not None and life.due_s is None and epoch > life.epoch:
            life.epoch = epoch

    def waiting(self) -> list[str]:
        return sorted(wid for wid, life in self.lives.items() if life.due_s is not None)

    def failed(self) -> list[str]:
        """Workers past the crash-loop limit: never started again."""
        return sorted(wid for wid, life in self.lives.items() if life.failed)
