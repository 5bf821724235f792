"""The serving process's side of the worker processes: it starts them (local processes, or Ray
actors), reports each death once with its cause, starts every dead worker again under its next
epoch on the restart policy's backoff (workers/process/supervisor.py), ends a hung or
never-registering incarnation, and remembers each worker's role and epoch as the router changes
them, so a restart comes back in the role the router last gave it, above every epoch it used.

Contract: built before the router's zmq address is known (`Launcher(config)`), started with it
(`start`); `dead()` is polled by the router's upkeep; `supervise()` runs as a task from the
first start on; `begin_stop()` turns every later death into the stop's (not restarted);
`down_for_good()` lists the workers that died and will not be started again (`--no-restart`,
or FAILED past `--max-crashes`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from pdserve.engine.config import EngineConfig
from pdserve.model.default import resolve_model
from pdserve.workers.process.launch import LaunchConfig, LocalCluster
from pdserve.workers.process.supervisor import RestartSchedule

log = logging.getLogger("pdserve.api.server")  # the supervisor's lines keep the serving log's name


class Launcher:
    """Defers building the worker launcher until the router's zmq address is known."""

    def __init__(self, config):  # api/server.py's ServeConfig (workers/ imports nothing above it)
        self.config = config
        self.impl = None
        self.schedule = RestartSchedule(config.restart)
        self.clock = time.monotonic
        self.stopping = False  # the server is stopping: a death is not restarted (`begin_stop`)
        self.gone: set[str] = set()  # died, and not to be started again (--no-restart, FAILED)

    def start(self, router_address: str, capability_key: str | None = None, control_keys=None) -> None:
        """`control_keys(worker_id, epoch)`: the router's CURVE key issuer (router/process/control_auth.py)."""
        cfg = self.config
        roles = tuple(role.value for role in cfg.shape().roles())
        launch = LaunchConfig(roles, _with_resolved_model(cfg.engine), cfg.threads_per_worker, cfg.pin_cpus,
                              cfg.trace_dir, cfg.layerwise_threshold_tokens, lease_s=cfg.lease_s, capability_key=capability_key,
                              tp=cfg.tp, kv_events=(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint),
                              lendable=cfg.mode == "splitwise", step_timeout_s=cfg.step_timeout_s)
        if cfg.ray:
            from pdserve.workers.process.ray_launch import RayCluster

            self.impl = RayCluster(launch, router_address, cfg.ray_address, cfg.ray_pack_pairs, control_keys=control_keys)
        else:
            self.impl = LocalCluster(launch, router_address, control_keys)
        self.impl.start()
        for wid in self.impl.worker_ids():
            self.schedule.on_started(wid, 1, self.clock())

    def dead(self) -> list[str]:
        """Workers that died since the last call (each death once); each is put on the restart
        schedule as it is reported."""
        gone = [] if self.impl is None else self.impl.dead()
        for wid in gone:
            epoch = self.schedule.lives[wid].epoch if wid in self.schedule.lives else 1
            if self.stopping:  # e.g. SIGTERM to the whole process group (systemd, `timeout`): it reached the workers too
                log.info("%s (epoch %d) %s: stopped with the server", wid, epoch, self.impl.exit_reason(wid))
                continue
            due = self.schedule.on_death(wid, self.clock())
            if due is None:
                self.gone.add(wid)
            log.warning("%s (epoch %d) %s; %s", wid, epoch, self.impl.exit_reason(wid), self._next_step(wid, due))
        return gone

    def _next_step(self, worker_id: str, due: float | None) -> str:
        """What the supervisor does after a death, in the log's words."""
        policy, life = self.config.restart, self.schedule.lives[worker_id]
        if life.failed:
            return (f"FAILED: {len(life.deaths_s)} deaths within {policy.crash_window_s:g} s (--max-crashes "
                    f"{policy.max_crashes}); not started again")
        if due is None:
            return "not restarted (--no-restart)"
        return (f"restarting in {due - self.clock():.1f} s (death {len(life.deaths_s)} of {policy.max_crashes} "
                f"within {policy.crash_window_s:g} s)")

    def begin_stop(self) -> None:
        """The server received its stop signal: from now on a worker's death is the stop's, logged
        as such and not restarted (the signal may have reached the workers' process group too)."""
        self.stopping = True

    async def supervise(self, poll_s: float = 0.1) -> None:
        """Start every dead worker whose backoff elapsed again, under its next epoch; end a restart
        that did not register in time (the schedule then starts it again). Nothing once stopping."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(poll_s)
            if self.stopping:
                continue
            for wid, epoch in self.schedule.due(self.clock()):
                try:
                    await loop.run_in_executor(None, self.impl.restart, wid, epoch)
                except Exception:  # e.g. the warm template died twice during the start: a crash of this incarnation
                    log.exception("%s: its start under epoch %d failed; counted as a crash", wid, epoch)
                    self.schedule.mark_restarted(wid, epoch, self.clock())
                    self.schedule.on_death(wid, self.clock())  # the backoff, then again (FAILED after --max-crashes)
                    continue
                self.schedule.mark_restarted(wid, epoch, self.clock())
            for wid, epoch in self.schedule.unregistered(self.clock()):  # hung while loading: no heartbeat to miss
                log.warning("%s (epoch %d) did not register within %g s of its restart: ending it", wid, epoch,
                            self.config.restart.register_timeout_s)
                loop.run_in_executor(None, self.impl.stop_hung, wid, 1.0)

    def note_registered(self, worker_id: str, epoch: int) -> None:
        """An incarnation registered: healthy from now (a long registration resets the backoff)."""
        self.schedule.on_registered(worker_id, epoch, self.clock())

    def retire_hung(self, worker_id: str, epoch: int, reason: str, grace_s: float = 1.0) -> None:
        """The router retired the worker's `epoch` (it missed its heartbeats, or a control message's
        acknowledgement: `reason`): end its process off the
        event loop (SIGKILL after `grace_s`); `dead()` then reports it and the schedule restarts it.
        Only the incarnation running that epoch is ended (a restarted one is not the hung one)."""
        life = self.schedule.lives.get(worker_id)
        if self.impl is not None and life is not None and life.epoch == epoch and life.due_s is None:
            log.warning("%s (epoch %d) %s: retired as hung, ending its process", worker_id, epoch, reason)
            asyncio.get_running_loop().run_in_executor(None, self.impl.stop_hung, worker_id, grace_s)

    def down_for_good(self) -> list[str]:
        """Workers that died and will not be started again."""
        return sorted(self.gone | set(self.schedule.failed()))

    def failed(self) -> list[str]:
        """Workers past the crash-loop limit (supervisor.py): not started again."""
        return self.schedule.failed()

    def note_key(self, public_key_hex: str, key_epoch: int) -> None:
        """The router revoked its capability key: restarts carry the new one."""
        self.impl.set_capability_key(public_key_hex, key_epoch)

    def note_role(self, worker_id: str, role: str, epoch: int) -> None:
        """A worker changed role under `epoch`: a restart starts it in that role, above that epoch."""
        self.impl.set_role(worker_id, role)
        self.schedule.note_epoch(worker_id, epoch)

    @property
    def num_restarts(self) -> int:
        return self.schedule.num_restarts

    def kill(self, worker_id: str) -> None:
        self.impl.kill(worker_id)

    def pid(self, worker_id: str) -> int:
        return self.impl.pid(worker_id)

    def stop(self) -> None:
        if self.impl is not None:
            self.impl.stop()

    def force_stop(self) -> None:
        """A second stop signal: end every worker now (the local ones killed, their pools unlinked)."""
        force = getattr(self.impl, "force_stop", None)
        if force is not None:
            force()


def _with_resolved_model(engine: EngineConfig) -> EngineConfig:
    return replace(engine, model=str(resolve_model(engine.model)))
