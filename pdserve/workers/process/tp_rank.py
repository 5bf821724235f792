"""Tensor-parallel shape of a deployment: how many ranks each role's workers run, and their cores.

Contract: `TpShape` is the `--tp N` / `--prefill-tp N` / `--decode-tp M` choice (a prefill worker
runs `prefill` ranks, a decode worker `decode`, a colocated or mixed worker `other`). A worker with
TP N > 1 is one worker process (rank 0: scheduling, block manager, handoff) plus N - 1 follower
processes (engine/tp_group.py); `worker_engine` gives its engine configuration: N ranks, one
torch thread each, rank r pinned to the r-th of the worker's cores. `worker_width` is the number
of cores a worker takes, max(threads, N): the local launcher hands each worker that many
consecutive cores of the machine (`worker_cores`, wrapping around when there are fewer), and the
Ray launcher reserves that many CPUs in the worker's placement bundle (ranks then run unpinned,
since Ray does not hand out specific cores). Both launchers build every worker's configuration
through `launch.worker_configs`, so a worker's ranks are set up the same way under either.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig


@dataclass(frozen=True)
class TpShape:
    prefill: int = 1
    decode: int = 1
    other: int = 1  # colocated and mixed workers

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "other"):
            if getattr(self, name) < 1:
                raise ValueError(f"tensor-parallel size of {name} workers must be >= 1, got {getattr(self, name)}")

    def for_role(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode}.get(role, self.other)

    @property
    def any_parallel(self) -> bool:
        return max(self.prefill, self.decode, self.other) > 1


def add_tp_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks per worker (each rank one process, one thread, its own core)")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N", help="prefill workers' TP size (default --tp)")
    p.add_argument("--decode-tp", type=int, default=None, metavar="M", help="decode workers' TP size (default --tp)")


def shape_from_args(args: argparse.Namespace) -> TpShape:
    tp = getattr(args, "tp", 1)
    tp = 1 if tp is None else tp
    prefill, decode = getattr(args, "prefill_tp", None), getattr(args, "decode_tp", None)
    return TpShape(prefill=tp if prefill is None else prefill, decode=tp if decode is None else decode, other=tp)


def worker_width(threads: int, tp: int) -> int:
    """Cores (or Ray CPUs) one worker takes: its torch threads at TP 1, one per rank at TP N."""
    return max(threads, tp)


def worker_cores(cpus: list[int], offset: int, width: int) -> tuple[int, ...]:
    """`width` consecutive cores from `offset` (wrapping)."""
    return tuple(cpus[(offset + k) % len(cpus)] for k in range(width))


def worker_engine(engine: EngineConfig, tp: int, threads: int, cores: tuple[int, ...]) -> EngineConfig:
    """The engine configuration of one worker: `threads` torch threads at TP 1, else `tp` ranks of
    one thread each pinned to `cores` (unpinned when `cores` is empty)."""
    if tp == 1:
        return replace(engine, num_threads=threads, tp=1, tp_cores=())
    return replace(engine, num_threads=1, tp=tp, tp_cores=tuple(cores))
