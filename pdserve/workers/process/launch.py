"""Start worker processes on this machine (the default deployment).

Contract: `LocalCluster` starts one OS process per worker, a fork of the warm template that
imported the worker's modules once (workers/process/warm_start.py; `PDSERVE_WORKER_START=exec` starts a
bare `python -m pdserve.workers.main` instead), so no state is inherited from the router
process, each with an explicit torch thread count and, when asked, a CPU affinity set: on a small
machine oversubscribed threads cost far more than they give.
`dead()` reports each worker whose process exited, once per death; `restart(worker, epoch)` starts
a dead one again under a new epoch (the supervisor decides when); `stop_hung(worker, grace_s)` ends
a worker the router retired for missed heartbeats (SIGTERM and SIGCONT, SIGKILL after the grace),
so its death is reported and it is restarted like any other; `kill()` exists for fault tests.
Whenever the launcher ends a worker (`stop_hung`, `stop`, `force_stop`) it ends the worker's
children too (its tensor-parallel followers, held before the worker is signalled:
workers/process/children.py), a stopped one included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig
from pdserve.lifetime import describe_exit
from pdserve.shm import reap_dead_pools
from pdserve.workers.process import children, warm_start
from pdserve.workers.config import WorkerConfig, encode_config
from pdserve.workers.control_keys import FD_ENV as CONTROL_KEYS_FD_ENV
from pdserve.workers.control_keys import ControlKeys, pipe_for
from pdserve.workers.process.tp_rank import TpShape, worker_cores, worker_engine, worker_width


START_ENV = "PDSERVE_WORKER_START"  # "fork" (the default: the warm template) or "exec"


@dataclass(frozen=True)
class LaunchConfig:
    roles: tuple[str, ...]  # one role per worker: "prefill" | "decode" | "mixed" | "colocated", prefill first
    engine: EngineConfig
    threads_per_worker: int = 1
    pin_cpus: bool = True
    trace_dir: str | None = None
    layerwise_threshold_tokens: int = 256
    heartbeat_s: float = 0.25
    lease_s: float = 30.0
    step_timeout_s: float = 60.0  # the engine loop's bound before heartbeats stop (workers/config.py)
    capability_key: str | None = None  # the router's public key (hex), given to every worker
    tp: TpShape = TpShape()  # tensor-parallel ranks per role (workers/process/tp_rank.py)
    kv_events: tuple[str | None, str | None] = (None, None)  # vLLM KV events: base endpoint, replay base
    lendable: bool = False  # splitwise mode: every worker can be lent to the other pool (workers/roles.py)


def offset_endpoint(base: str | None, index: int) -> str | None:
    """Worker `index`'s KV-events endpoint (the base port plus its index), or None."""
    from pdserve.workers.kv_publisher import endpoint_for
    return None if base is None else endpoint_for(base, index)


def worker_configs(launch: LaunchConfig, router_address: str, host_id: str | None = None) -> list[WorkerConfig]:
    host = host_id or socket.gethostname()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    configs, counters, offset = [], {}, 0
    for role in launch.roles:
        n = counters[role] = counters.get(role, -1) + 1
        worker_id = f"{role}-{n}"
        per, tp = launch.threads_per_worker, launch.tp.for_role(role)
        affinity = worker_cores(cpus, offset, worker_width(per, tp)) if launch.pin_cpus else ()
        offset += worker_width(per, tp)
        trace = os.path.join(launch.trace_dir, f"{worker_id}.jsonl") if launch.trace_dir else None
        steps = os.path.join(launch.trace_dir, f"{worker_id}.steps.jsonl") if launch.trace_dir else None
        configs.append(WorkerConfig(
            worker_id=worker_id, role=role, router_address=router_address, host_id=host,
            engine=worker_engine(launch.engine, tp, per, affinity), cpu_affinity=affinity, trace_path=trace, step_log_path=steps,
            layerwise_threshold_tokens=launch.layerwise_threshold_tokens, heartbeat_s=launch.heartbeat_s, lease_s=launch.lease_s,
            step_timeout_s=launch.step_timeout_s,
            exit_with_parent=True, capability_key=launch.capability_key,
            kv_events_endpoint=offset_endpoint(launch.kv_events[0], len(configs)),
            kv_events_replay_endpoint=offset_endpoint(launch.kv_events[1], len(configs)), lendable=launch.lendable,
        ))
    return configs


class LocalCluster:
    def __init__(self, launch: LaunchConfig, router_address: str,
                 control_keys: Callable[[str, int], ControlKeys] | None = None):
        self.launch = launch
        self.control_keys = control_keys  # the router's key issuer: one key pair per (worker, epoch)
        self.configs = worker_configs(launch, router_address)
        self.procs: dict[str, subprocess.Popen] = {}
        self._reported: set[str] = set()

    def start(self) -> None:
        for cfg in self.configs:
            self._spawn(cfg)

    def worker_ids(self) -> list[str]:
        return [c.worker_id for c in self.configs]

    def _spawn(self, cfg: WorkerConfig) -> None:
        keys_fd = None  # through an inherited pipe: `ps` shows argv to everyone, /proc/PID/environ to the user
        if self.control_keys is not None:
            keys_fd = pipe_for(self.control_keys(cfg.worker_id, cfg.epoch))
        try:
            if os.environ.get(START_ENV, "fork") == "exec" or not warm_start.supported():  # a bare interpreter
                env = dict(os.environ)
                if keys_fd is not None:
                    env[CONTROL_KEYS_FD_ENV] = str(keys_fd)
                cmd = [sys.executable, "-m", "pdserve.workers.main", encode_config(cfg)]
                self.procs[cfg.worker_id] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env,
                                                             pass_fds=() if keys_fd is None else (keys_fd,))
            else:  # a fork of the warm template (workers/process/warm_start.py)
                self.procs[cfg.worker_id] = warm_start.start(encode_config(cfg), keys_fd)
        finally:
            if keys_fd is not None:
                os.close(keys_fd)

    def restart(self, worker_id: str, epoch: int) -> None:
        """Start a dead worker again under `epoch` (same id, role, cores and config otherwise)."""
        if self.procs[worker_id].poll() is None:
            raise ValueError(f"{worker_id} is still running")
        cfg = next(c for c in self.configs if c.worker_id == worker_id)
        self._spawn(replace(cfg, epoch=epoch))
        self._reported.discard(worker_id)

    def set_capability_key(self, public_key_hex: str, key_epoch: int) -> None:
        """The router revoked its key: a restarted worker verifies with the new one."""
        self.configs = [replace(c, capability_key=public_key_hex, capability_key_epoch=key_epoch) for c in self.configs]

    def set_role(self, worker_id: str, role: str) -> None:
        """The worker changed role (workers/roles.py): a restart brings it back in that role."""
        self.configs = [replace(c, role=role) if c.worker_id == worker_id else c for c in self.configs]

    def dead(self) -> list[str]:
        gone = [wid for wid, p in self.procs.items() if p.poll() is not None and wid not in self._reported]  # each death once
        self._reported.update(gone)
        return gone

    def exit_reason(self, worker_id: str) -> str:
        """How the worker's process ended, for the log: a signal by name, else the exit code."""
        return describe_exit(self.procs[worker_id].poll())

    def pid(self, worker_id: str) -> int:
        return self.procs[worker_id].pid

    def kill(self, worker_id: str) -> None:
        os.kill(self.procs[worker_id].pid, signal.SIGKILL)

    def stop_hung(self, worker_id: str, grace_s: float = 1.0) -> None:
        """End a worker retired for missed heartbeats, or one that never registered: a stopped
        process gets SIGCONT so that it can take the SIGTERM; one that has not exited after
        `grace_s` is killed; then its children (`_terminate`, `_reap`)."""
        proc = self.procs[worker_id]
        if proc.poll() is not None:
            return
        held = _terminate(proc)
        _reap(proc, held, grace_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Workers were asked to shut down; wait, then terminate any that did not (continued first:
        a stopped worker takes no SIGTERM, nor notices its router is gone), then kill them and their
        children; then unlink the pool segments of those that could not (a killed worker skips its
        own unlink)."""
        held: dict[str, list[int]] = {}
        for worker_id, proc in self.procs.items():
            try:
                proc.wait(timeout=timeout_s / max(1, len(self.procs)))
            except subprocess.TimeoutExpired:
                held[worker_id] = _terminate(proc)
        for worker_id, proc in self.procs.items():
            _reap(proc, held.get(worker_id, []), 2.0)
        for worker_id in self.procs:
            reap_dead_pools(worker_id)

    def force_stop(self) -> None:
        """Kill every worker now (a stopped one too) and its children, and unlink what they leave:
        a second stop signal."""
        held = {worker_id: children.hold(proc.pid) if proc.poll() is None else [] for worker_id, proc in self.procs.items()}
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for worker_id, proc in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
            children.kill_held(held[worker_id])
            reap_dead_pools(worker_id)


def _terminate(proc) -> list[int]:
    """SIGTERM and SIGCONT a live worker; its children, held first (workers/process/children.py):
    a follower rank stopped before it tied its life to the worker's outlives it otherwise."""
    held = children.hold(proc.pid)
    proc.terminate()
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
    return held


def _reap(proc, held: list[int], grace_s: float) -> None:
    """Wait `grace_s` for the worker, SIGKILL it if it has not exited, then its held children."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    children.kill_held(held)
