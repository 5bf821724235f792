"""Place the same workers as Ray actors, for multi-node deployments (`pdserve serve --ray`).

Contract: `RayCluster` has `LocalCluster`'s interface (start, dead, restart, pid, kill, stop). Each worker
is one actor whose `run` is `serve_worker`; Ray only places and supervises processes. Requests
still flow over the router's zmq socket and K/V still moves on the handoff transports: a worker's
`host_id` is its Ray node id, so the router picks shared memory for a pair on one node and TCP
across nodes. Placement uses placement groups: one PACK group for all workers by default, or with
`pack_pairs` one STRICT_PACK group per (prefill-i, decode-i) pair so the K/V exchange stays on a
node. Configs are completed after placement, once each actor's node is known.

Tensor parallelism: a worker with TP N is one actor (rank 0) whose engine spawns its N - 1 follower
processes on the actor's node, exactly as a local worker process does (engine/tp_group.py: gloo
on 127.0.0.1, one torch thread per rank, followers die with the actor). Its bundle reserves
`worker_width(threads, N)` CPUs; the ranks are not pinned (Ray hands out CPU counts, not cores).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.workers.control_keys import ControlKeys
from pdserve.workers.process.launch import LaunchConfig, worker_configs
from pdserve.workers.process.tp_rank import worker_width
from pdserve.workers.worker import WorkerConfig, serve_worker

log = logging.getLogger("pdserve.ray")


@dataclass(frozen=True)
class Placement:
    """Where an actor landed, asked once before it starts serving."""

    pid: int
    node_id: str
    node_ip: str
    has_model: bool


@ray.remote
class WorkerActor:
    def __init__(self, control_keys: ControlKeys | None = None):
        self.control_keys = control_keys  # this incarnation's CURVE keys (control_keys.py), never in a config

    def describe(self, model_dir: str) -> Placement:
        ctx = ray.get_runtime_context()
        return Placement(os.getpid(), ctx.get_node_id(), ray.util.get_node_ip_address(), os.path.isdir(model_dir))

    def run(self, config: WorkerConfig) -> None:
        """Serves until the router sends Shutdown; returns (or raises) when the worker ends."""
        serve_worker(config, self.control_keys)


def group_workers(worker_ids: list[str], pack_pairs: bool) -> list[tuple[str, list[str]]]:
    """Worker ids -> placement groups as (strategy, members).

    With `pack_pairs`, prefill-i and decode-i share a STRICT_PACK group; workers without a partner
    (colocated replicas, surplus prefill or decode) share one PACK group.
    """
    if not pack_pairs:
        return [("PACK", list(worker_ids))]
    ids = set(worker_ids)
    pairs = [[w, "decode-" + w.removeprefix("prefill-")] for w in worker_ids if w.startswith("prefill-")]
    pairs = [p for p in pairs if p[1] in ids]
    paired = {w for p in pairs for w in p}
    rest = [w for w in worker_ids if w not in paired]
    return [("STRICT_PACK", p) for p in pairs] + ([("PACK", rest)] if rest else [])


def connect(ray_address: str | None) -> bool:
    """Join the Ray cluster at `ray_address` (or $RAY_ADDRESS), else start a local one.

    Returns True when this call started Ray, so the caller owns its shutdown.
    """
    if ray.is_initialized():
        return False
    address = ray_address or os.environ.get("RAY_ADDRESS") or "local"
    local = {"num_cpus": os.cpu_count()} if address == "local" else {}
    ray.init(address=address, include_dashboard=False, log_to_driver=True, **local)
    return True


class RayCluster:
    def __init__(self, launch: LaunchConfig, router_address: str, ray_address: str | None = None,
                 pack_pairs: bool = False, cpus_per_worker: float | None = None, placement_timeout_s: float = 120.0,
                 control_keys: Callable[[str, int], ControlKeys] | None = None):
        self.launch = launch
        self.control_keys = control_keys  # the router's key issuer: one key pair per (worker, epoch)
        self.ray_address, self.pack_pairs = ray_address, pack_pairs
        self.placement_timeout_s = placement_timeout_s
        # Ray does not hand out specific cores: built unpinned (no affinity, TP ranks unpinned);
        # host_id and handoff_host are filled in per node after placement.
        self.configs = {c.worker_id: c for c in worker_configs(replace(launch, pin_cpus=False), router_address)}
        # CPUs each worker's bundle reserves: one per torch thread, or one per TP rank
        self.cpus = {wid: float(worker_width(launch.threads_per_worker, c.engine.tp)) if cpus_per_worker is None
                     else cpus_per_worker for wid, c in self.configs.items()}
        self.groups: list[PlacementGroup] = []
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.bundles: dict[str, tuple[PlacementGroup, int]] = {}  # worker id -> its placement bundle
        self.placements: dict[str, Placement] = {}
        self.runs: dict[ray.ObjectRef, str] = {}  # run ref -> worker id, until dead() reports it
        self._owns_ray = False

    def start(self) -> None:
        self._owns_ray = connect(self.ray_address)
        try:
            for strategy, members in group_workers(list(self.configs), self.pack_pairs):
                self._place_group(strategy, members)
            self._locate()
            for wid, actor in self.actors.items():
                self.runs[actor.run.remote(self._placed_config(wid))] = wid
        except BaseException:
            self.stop(timeout_s=0.0)
            raise

    def _place_group(self, strategy: str, members: list[str]) -> None:
        cpus = [self.cpus[wid] for wid in members]
        pg = placement_group([{"CPU": n} for n in cpus], strategy=strategy)
        self.groups.append(pg)
        if not pg.wait(self.placement_timeout_s):
            raise RuntimeError(f"placement group {strategy} {members} ({cpus} CPUs) not placed "
                               f"within {self.placement_timeout_s}s; cluster has {ray.cluster_resources()}")
        for index, wid in enumerate(members):
            self.bundles[wid] = (pg, index)
            self.actors[wid] = self._new_actor(wid)

    def worker_ids(self) -> list[str]:
        return list(self.configs)

    def _new_actor(self, worker_id: str, epoch: int = 1) -> ray.actor.ActorHandle:
        pg, index = self.bundles[worker_id]
        in_group = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        keys = self.control_keys(worker_id, epoch) if self.control_keys is not None else None
        return WorkerActor.options(num_cpus=self.cpus[worker_id], scheduling_strategy=in_group).remote(keys)

    def restart(self, worker_id: str, epoch: int) -> None:
        """A new actor in the dead worker's bundle, run under `epoch` (supervisor.py decides when)."""
        ray.kill(self.actors[worker_id], no_restart=True)
        actor = self.actors[worker_id] = self._new_actor(worker_id, epoch)
        self.placements[worker_id] = ray.get(actor.describe.remote(self.launch.engine.model))
        self.runs[actor.run.remote(replace(self._placed_config(worker_id), epoch=epoch))] = worker_id

    def _locate(self) -> None:
        """Ask every actor once where it runs; fail early if a node lacks the checkpoint."""
        model_dir = self.launch.engine.model
        refs = {wid: actor.describe.remote(model_dir) for wid, actor in self.actors.items()}
        self.placements = dict(zip(refs, ray.get(list(refs.values()))))
        missing = {p.node_ip for p in self.placements.values() if not p.has_model}
        if missing:
            raise RuntimeError(f"model directory {model_dir} is missing on node(s) {sorted(missing)}: "
                               "put the checkpoint at the same path on every node (e.g. a shared filesystem)")

    def set_capability_key(self, public_key_hex: str, key_epoch: int) -> None:
        """The router revoked its key: a restarted worker verifies with the new one."""
        self.configs = {wid: replace(c, capability_key=public_key_hex, capability_key_epoch=key_epoch)
                        for wid, c in self.configs.items()}

    def set_role(self, worker_id: str, role: str) -> None:
        """The worker changed role (workers/roles.py): a restart brings it back in that role."""
        self.configs[worker_id] = replace(self.configs[worker_id], role=role)

    def _placed_config(self, worker_id: str) -> WorkerConfig:
        where = self.placements[worker_id]
        return replace(self.configs[worker_id], host_id=where.node_id, handoff_host=where.node_ip, exit_with_parent=False)

    def dead(self) -> list[str]:
        if not self.runs:
            return []
        ended, _ = ray.wait(list(self.runs), num_returns=len(self.runs), timeout=0)
        gone = [self.runs.pop(ref) for ref in ended]
        for wid, ref in zip(gone, ended):
            _log_end(wid, ref)
        return gone

    def exit_reason(self, worker_id: str) -> str:
        """The actor's end, for the log (the line `dead()` wrote says why, when Ray knows)."""
        return "its actor ended"

    def pid(self, worker_id: str) -> int:
        return self.placements[worker_id].pid

    def kill(self, worker_id: str) -> None:
        ray.kill(self.actors[worker_id], no_restart=True)

    def stop_hung(self, worker_id: str, grace_s: float = 1.0) -> None:
        """A worker retired for missed heartbeats: its actor is killed (its run ends, `dead()` sees it)."""
        self.kill(worker_id)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Workers were asked to shut down; wait briefly, then kill the actors and free the groups."""
        if not ray.is_initialized():
            return
        if self.runs and timeout_s > 0:
            ray.wait(list(self.runs), num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        for pg in self.groups:
            remove_placement_group(pg)
        self.actors, self.groups, self.runs = {}, [], {}
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _log_end(worker_id: str, ref: ray.ObjectRef) -> None:
    try:
        ray.get(ref, timeout=0)
    except Exception as err:  # the actor died or serve_worker raised: say why once
        log.warning("worker %s ended: %s", worker_id, err)
