"""A tensor-parallel engine: this process is rank 0, follower processes run the other shards.

Contract: with `EngineConfig.tp = N > 1` the engine process stays the only scheduler (block
manager, sequences, sampling); `start_group` spawns N - 1 follower processes, each of which loads
the checkpoint, keeps its shard (`model/tp.py`), maps the engine's K/V pool (which must live in
shared memory) and joins a gloo process group on 127.0.0.1. Every step, `TpLeader.forward`
broadcasts the step's rows (token ids, positions, attention metadata, logits rows) and then runs
rank 0's shard; the followers run theirs on the same rows, so the row-parallel all_reduces pair
up. Scheduling needs nothing else from the followers: the engine's state is on rank 0 only, and
every rank writes its own K/V heads into the one shared logical pool. `TpLeader.tally` counts
rank 0's seconds in each step's broadcast and all_reduces per phase (engine/tp_tally.py), which
the worker's heartbeat reports.

Placement: rank r is pinned to core `cores[r % len(cores)]` with one torch thread (`pin_rank`).
Lifetime: a follower asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG,
then re-checks its parent) before it imports torch (`lifetime.run_tied`), so a killed worker
leaves no followers; `TpLeader.close` stops and joins them. Rank 0 joins the group while it
watches its followers: one that ends before the group is whole fails the start at once
(`TpStartError`, naming the rank and how it ended), and a start that raises kills the followers.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.engine.kv.kv_pool import TORCH_DTYPES, KvPool
from pdserve.engine.tp_tally import CollectiveTally
from pdserve.lifetime import describe_exit, run_tied
from pdserve.model.config import load_config
from pdserve.model.loader import load_state_dict
from pdserve.model.numerics import resolve_compute_dtype
from pdserve.model.tp import TpLlamaModel, check_tp
from pdserve.ports import free_local_port

GROUP_TIMEOUT = timedelta(days=30)  # a follower waits in broadcast for as long as the worker idles
# every rank joins within this long, or the join raises (a rank stopped or hung at start, a port taken
# between free_local_port() and the store's bind): with the group's own timeout the join waited for good;
# a rank that died is seen at once (`join_watching`)
JOIN_TIMEOUT = timedelta(seconds=300)  # past any skew between ranks loading their shards
FOLLOWER_ENTRY = "pdserve.engine.tp_group:follower_main"
WATCH_S = 0.05  # how often rank 0 looks at its followers while it waits in the join


@dataclass(frozen=True)
class RankSpec:
    """What a follower needs to build its shard and join the group (crosses the spawn boundary)."""

    model_dir: str
    dtype: str
    compute_dtype: str | None
    batch_invariant: bool
    tp: int
    port: int
    pool_shm: str
    num_blocks: int
    abi: KvAbi
    cores: tuple[int, ...]


def rank_core(cores: tuple[int, ...], rank: int) -> int | None:
    return cores[rank % len(cores)] if cores else None


def pin_rank(cores: tuple[int, ...], rank: int) -> None:
    """Pin this process to rank `rank`'s core (when cores are given) and use one torch thread."""
    core = rank_core(cores, rank)
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def init_group(port: int, rank: int, tp: int, join_timeout: timedelta = JOIN_TIMEOUT) -> None:
    """Join the gloo group of `tp` ranks whose rank 0 serves its store at `port`; raises
    (RuntimeError, or DistStoreError, a RuntimeError) when the group is not whole by `join_timeout`."""
    store = dist.TCPStore("127.0.0.1", port, tp, is_master=rank == 0, timeout=join_timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp, timeout=GROUP_TIMEOUT)


class TpStartError(RuntimeError):
    """A follower rank ended before its group was whole: this start of the engine failed."""


def join_watching(port: int, tp: int, procs: list, join_timeout: timedelta = JOIN_TIMEOUT) -> None:
    """`init_group` as rank 0, raising `TpStartError` as soon as a follower in `procs` (rank i + 1)
    has ended rather than at `join_timeout`. The join runs in a daemon thread; after such a raise
    it stays blocked in the store until `join_timeout` (the caller is failing its start)."""
    outcome: list[BaseException | None] = []
    joiner = threading.Thread(target=_join_into, args=(outcome, port, tp, join_timeout), daemon=True, name="tp-join")
    joiner.start()
    while not outcome:
        for rank, p in enumerate(procs, start=1):
            if p.exitcode is not None:
                raise TpStartError(f"tensor-parallel rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)} "
                                   f"before the group was whole")
        joiner.join(WATCH_S)
    if outcome[0] is not None:
        raise outcome[0]


def _join_into(outcome: list, port: int, tp: int, join_timeout: timedelta) -> None:
    try:
        init_group(port, 0, tp, join_timeout)
    except BaseException as exc:  # handed to the watching thread, which raises it
        outcome.append(exc)
    else:
        outcome.append(None)


def kill_followers(procs: list) -> None:
    """SIGKILL (a stopped one too) and reap every follower that was started."""
    for p in procs:
        if p.pid is not None:
            p.kill()
            p.join()


def build_shard(spec: RankSpec, rank: int, state: dict[str, torch.Tensor] | None = None) -> TpLlamaModel:
    config = load_config(spec.model_dir)
    dtype = TORCH_DTYPES[spec.dtype]
    if state is None:
        state = load_state_dict(spec.model_dir, config, dtype)
    compute = resolve_compute_dtype(spec.dtype, spec.compute_dtype)
    return TpLlamaModel(config, state, dtype, compute, spec.batch_invariant, rank=rank, tp=spec.tp)


def follower_main(spec: RankSpec, rank: int) -> None:
    """A follower's whole life (tied to rank 0's by `lifetime.run_tied`): build, join, run every
    broadcast step, stop on `None`."""
    pin_rank(spec.cores, rank)
    model = build_shard(spec, rank)
    pool = KvPool(spec.abi, spec.num_blocks, shm_name=spec.pool_shm, create=False)
    init_group(spec.port, rank, spec.tp)
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            token_ids, positions, meta, logits_rows = box[0]
            model.forward(token_ids, positions, meta, pool.tensor, logits_rows)
    finally:
        dist.destroy_process_group()
        pool.close()


class TpLeader:
    """Rank 0: the model object the engine's runner calls. Attributes other than `forward` and
    `close` are rank 0's shard's (`dtype`, `products`, `config`, ...)."""

    def __init__(self, shard: TpLlamaModel, procs: list):
        self.shard = shard
        self.procs = procs
        self.closed = False
        self.owns_pool = False  # the engine made the shared pool only for this group
        self.tally = CollectiveTally()  # rank 0's collective seconds per phase, for the heartbeat (tp_tally.py)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["shard"], name)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta, kv: torch.Tensor,
                logits_rows: torch.Tensor, layer_hook=None) -> torch.Tensor:
        """Broadcast the step's rows, then run rank 0's shard -> logits [R, V] fp32. `layer_hook`
        runs on rank 0 only, after layer i's attention and before its MLP: no follower passes layer
        i's down_proj all_reduce until it returns, so a hook that waits for K/V to land (a
        KV-Runahead stage's next prefix layer) also holds back the followers' next layer."""
        t0 = time.perf_counter()
        dist.broadcast_object_list([(token_ids, positions, meta, logits_rows)], src=0)
        broadcast_s, reduce_s = time.perf_counter() - t0, self.shard.reduce_s
        logits = self.shard.forward(token_ids, positions, meta, kv, logits_rows, layer_hook)
        phase = "prefill" if meta.prefills else "decode"
        self.tally.add(phase, int(token_ids.shape[0]), self.shard.reduce_s - reduce_s, broadcast_s)
        return logits

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop and join the followers (idempotent). A stopped follower is continued first so that
        it can take the stop; one that does not take it within `timeout_s` (hung) is killed, which
        ends the broadcast, so a worker's shutdown never waits on a rank for good."""
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, TypeError):  # TypeError: never started (pid None)
                os.kill(p.pid, signal.SIGCONT)
        stop = threading.Thread(target=self._send_stop, daemon=True, name="tp-stop")
        stop.start()
        stop.join(timeout_s)
        if stop.is_alive():  # a rank did not take the stop: killed, the broadcast fails and returns
            for p in self.procs:
                p.kill()
            stop.join(timeout_s)
        if not stop.is_alive():  # the group is torn down only once nothing waits in it
            dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join()

    @staticmethod
    def _send_stop() -> None:
        try:
            dist.broadcast_object_list([None], src=0)
        except RuntimeError:  # a follower is gone: the group cannot carry the stop
            pass

    @property
    def follower_pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def start_group(spec_base: dict, state: dict[str, torch.Tensor], pool: KvPool) -> TpLeader:
    """Spawn the followers over `pool` (shared memory), join as rank 0, build rank 0's shard.

    `spec_base`: RankSpec's fields other than port, pool_shm, num_blocks, abi."""
    if pool.shm_name is None:
        raise ValueError("a tensor-parallel engine needs its K/V pool in shared memory (EngineConfig.kv_shm_name)")
    spec = RankSpec(**spec_base, port=free_local_port(), pool_shm=pool.shm_name, num_blocks=pool.num_blocks,
                    abi=pool.abi)
    check_tp(load_config(spec.model_dir), spec.tp)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_tied, args=(os.getpid(), FOLLOWER_ENTRY, pickle.dumps((spec, r))), daemon=True,
                         name=f"pdserve-tp{r}") for r in range(1, spec.tp)]
    try:
        for p in procs:
            p.start()
        pin_rank(spec.cores, 0)
        shard = build_shard(spec, 0, state)
        join_watching(spec.port, spec.tp, procs)
    except BaseException:  # a rank lost, a shard that did not build, a join past its timeout
        kill_followers(procs)
        raise
    return TpLeader(shard, procs)


def private_pool_name(tp: int) -> str | None:
    """A fresh shared-memory name for a TP engine's pool when its caller gave none; None at TP 1."""
    return f"pdserve-tp-{os.getpid()}-{secrets.token_hex(12)}" if tp > 1 else None


def start_engine_group(config, model_dir, state: dict[str, torch.Tensor], pool: KvPool) -> TpLeader:
    """`start_group` from an `EngineConfig` (its tp, tp_cores, dtypes, batch invariance)."""
    base = dict(model_dir=str(model_dir), dtype=config.dtype, compute_dtype=config.compute_dtype,
                batch_invariant=config.batch_invariant, tp=config.tp, cores=tuple(config.tp_cores))
    leader = start_group(base, state, pool)
    leader.owns_pool = config.kv_shm_name is None
    return leader


def close_engine_group(engine) -> None:
    """Stop the engine's followers (if any) and unlink the pool it made for them."""
    leader = engine.model
    if isinstance(leader, TpLeader) and not leader.closed:
        leader.close()
        if getattr(leader, "owns_pool", False):
            engine.pool.close(unlink=True)
