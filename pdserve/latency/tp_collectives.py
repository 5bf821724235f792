"""Time the collectives a TP step of our engine issues, on this machine (issue 23's pricing).

Contract: `measure_collectives(tp, row_bytes)` spawns `tp - 1` follower processes, joins a gloo
group on 127.0.0.1 with them (as engine/tp_group.py does: rank r pinned to core r mod the CPU
count when there are at least `tp` CPUs, one torch thread per rank) and returns the
`CollectiveCosts` that latency/tp_scaling.py prices a TP step with:

    allreduce_s           one all_reduce of a [1, d] tensor (gloo's per-call latency, alpha)
    allreduce_s_per_byte  the slope from a [1, d] to a [PREFILL_ROWS, d] all_reduce (1 / beta)
    step_sync_s           rank 0's broadcast_object_list of a decode step's rows (token ids,
                          positions, block tables, logits rows of DECODE_ROWS sequences): the
                          pickled broadcast engine/tp_group.py sends before every step

`row_bytes` is one activation row, d x the compute dtype's size: the engine's all_reduce moves
[rows, d] row-parallel partials.

Engine-shaped (`shape`: a `LayerShape`, given by `profile_section`): the same two all_reduces
issued as a TP step issues them, each after the rank's share of the products before it (a layer's
q|k|v and o_proj, or its gate|up and down_proj, alternating, as model/tp.py runs them); rank 0's
wall time inside the all_reduce calls only (what model/tp.py's `reduce_s` counts in a served
step), averaged over the bursts (not their least: the waits under load are what it is for):

    shaped_allreduce_s            per call at [1, d] (the products' rows: 1)
    shaped_allreduce_s_per_byte   the slope to [PREFILL_ROWS, d]

On a quiet machine these equal the back-to-back figures; when a rank loses its core during its
products its partner waits for it at the next call, which the back-to-back calls (no products
between them) never see. `engine_shaped()` is the costs with these in place of alpha and beta. Each figure is the least over `bursts` of a burst's mean over
`calls` back-to-back calls: the floor a quiet machine reaches; on a loaded machine the median
(`median_*`, recorded beside it) includes waits for a descheduled partner, which is the load's
cost, not the collective's. `to_dict`/`from_dict` are the `collectives` section of a profile
JSON (`pdserve profile --tp N`).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

PREFILL_ROWS = 512  # the larger all_reduce of the slope: a 512-token prefill's partial
DECODE_ROWS = 4  # the broadcast step: a decode step of four sequences
BLOCKS_PER_ROW = 64  # block-table width of the broadcast step (1,024 tokens of 16-token blocks)


@dataclass(frozen=True)
class LayerShape:
    """One layer's product widths (model/tp.py shards them by TP size)."""

    hidden: int
    q_dim: int  # query heads x head dim
    kv_dim: int  # K/V heads x head dim
    intermediate: int


@dataclass(frozen=True)
class CollectiveCosts:
    tp: int
    pinned: bool  # rank r on core r (a served worker) or wherever the kernel puts it (`pdserve profile`)
    allreduce_s: float
    allreduce_s_per_byte: float
    step_sync_s: float
    median_allreduce_s: float = 0.0
    median_step_sync_s: float = 0.0
    shaped_allreduce_s: float | None = None  # engine-shaped (module docstring); None: not measured
    shaped_allreduce_s_per_byte: float | None = None
    median_shaped_allreduce_s: float | None = None

    def engine_shaped(self) -> CollectiveCosts:
        """These costs with the engine-shaped alpha and beta (itself when they were not measured)."""
        if self.shaped_allreduce_s is None or self.shaped_allreduce_s_per_byte is None:
            return self
        return replace(self, allreduce_s=self.shaped_allreduce_s, allreduce_s_per_byte=self.shaped_allreduce_s_per_byte)

    def __post_init__(self) -> None:
        if self.tp < 2 or min(self.allreduce_s, self.allreduce_s_per_byte, self.step_sync_s) < 0:
            raise ValueError(f"need tp >= 2 and non-negative costs, got {self}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CollectiveCosts:
        kinds = {"tp": int, "pinned": bool}
        return cls(**{k: None if v is None else kinds.get(k, float)(v)
                      for k, v in d.items() if k in cls.__dataclass_fields__})


def _step_rows():
    """A stand-in for one decode step's broadcast tuple (engine/tp_group.py TpLeader.forward)."""
    import torch

    ids = torch.zeros(DECODE_ROWS, dtype=torch.long)  # [R]
    meta = {"block_tables": torch.zeros(DECODE_ROWS, BLOCKS_PER_ROW, dtype=torch.int32),  # [R, blocks]
            "context_lens": torch.zeros(DECODE_ROWS, dtype=torch.int32), "slots": torch.zeros(DECODE_ROWS, dtype=torch.long)}
    return ids, ids.clone(), meta, torch.arange(DECODE_ROWS)


def _bursts(call, bursts: int, calls: int) -> list[float]:
    """Each burst's mean seconds per call (after one untimed call)."""
    call()
    means = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - t0) / calls)
    return means


class _Products:
    """A rank's share of one layer's products at `rows` rows: call(half) runs the attention half
    (q|k|v, then o_proj) or the MLP half (gate|up, then down_proj) and returns the [rows, d] partial.
    The products run as the engine's bf16 products do on this CPU (numerics.choose_plan: on the
    AVX2 kind its own kernel, where torch's bf16 GEMM is some 40x slower at 512 rows)."""

    def __init__(self, shape: LayerShape, tp: int, rows: int):
        import torch

        from pdserve.model.numerics import choose_plan, prepare

        bf16, d = torch.bfloat16, shape.hidden
        shapes = (((shape.q_dim + 2 * shape.kv_dim) // tp, d), (d, shape.q_dim // tp),  # [N, K] as F.linear
                  (2 * shape.intermediate // tp, d), (d, shape.intermediate // tp))
        plan = choose_plan(bf16, False, shapes).plan
        self.qkv, self.o, self.gate_up, self.down = (prepare(torch.full(s, 1e-3, dtype=bf16), plan) for s in shapes)
        self.x = torch.ones(rows, d, dtype=bf16)  # [rows, d]
        self.q_cols, self.ff_cols = shape.q_dim // tp, shape.intermediate // tp
        self.half = 0

    def __call__(self):
        from pdserve.model.numerics import linear

        self.half ^= 1
        if self.half:
            return linear(linear(self.x, self.qkv)[:, : self.q_cols], self.o)  # [rows, d]
        return linear(linear(self.x, self.gate_up)[:, : self.ff_cols], self.down)  # [rows, d]


def _shaped(shape: LayerShape, tp: int, rows: int, bursts: int, calls: int) -> list[float]:
    """Per burst: mean wall seconds per call inside all_reduce, each call after the products."""
    import torch.distributed as dist

    products = _Products(shape, tp, rows)
    dist.all_reduce(products())  # untimed, as `_bursts`
    means = []
    for _ in range(bursts):
        inside = 0.0
        for _ in range(calls):
            partial = products()  # [rows, d]
            t0 = time.perf_counter()
            dist.all_reduce(partial)
            inside += time.perf_counter() - t0
        means.append(inside / calls)
    return means


def _run_rank(rank: int, tp: int, port: int, row_elems: int, bursts: int, calls: int, pinned: bool,
              shape: LayerShape | None = None) -> dict | None:
    """Every rank issues the same calls in the same order; rank 0 returns its timings."""
    import torch
    import torch.distributed as dist

    from pdserve.engine.tp_group import init_group, pin_rank

    cpus = os.cpu_count() or 1
    pin_rank(tuple(range(cpus)) if pinned and cpus >= tp else (), rank)
    init_group(port, rank, tp)
    try:
        small = torch.ones(1, row_elems, dtype=torch.bfloat16)  # [1, d]
        large = torch.ones(PREFILL_ROWS, row_elems, dtype=torch.bfloat16)  # [PREFILL_ROWS, d]
        step = _step_rows()
        timed = {
            "small": _bursts(lambda: dist.all_reduce(small), bursts, calls),
            "large": _bursts(lambda: dist.all_reduce(large), bursts, max(1, calls // 8)),
            "sync": _bursts(lambda: dist.broadcast_object_list([step if rank == 0 else None], src=0), bursts, calls),
        }
        if shape is not None:
            timed["shaped_small"] = _shaped(shape, tp, 1, bursts, calls)
            timed["shaped_large"] = _shaped(shape, tp, PREFILL_ROWS, bursts, max(1, calls // 8))
        return timed if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, tp: int, port: int, row_elems: int, bursts: int, calls: int, pinned: bool, shape, results) -> None:
    timed = _run_rank(rank, tp, port, row_elems, bursts, calls, pinned, shape)
    if timed is not None:
        results.put(timed)


def measure_collectives(tp: int, row_bytes: int, pinned: bool = True, bursts: int = 7, calls: int = 48,
                        shape: LayerShape | None = None) -> CollectiveCosts:
    """Time gloo's all_reduce and the step broadcast at TP `tp` for rows of `row_bytes` bytes (and,
    given the model's `shape`, the engine-shaped all_reduce). Every rank is a spawned process:
    the caller's threads, affinity and process group stay as they are."""
    import torch.multiprocessing as mp

    from pdserve.ports import free_local_port

    if tp < 2:
        raise ValueError(f"collectives need tp >= 2, got {tp}")
    port, row_elems = free_local_port(), row_bytes // 2  # timed as bf16: the byte count is what matters
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, row_elems, bursts, calls, pinned, shape, results), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    try:
        timed = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return costs_from_timings(tp, pinned, timed, row_elems * 2, shape)


def costs_from_timings(tp: int, pinned: bool, timed: dict[str, list[float]], row_bytes: int,
                       shape: LayerShape | None) -> CollectiveCosts:
    """Rank 0's per-burst seconds (`_run_rank`) -> the costs. The back-to-back calls moved rows
    of `row_bytes`; the engine-shaped ones move the products' bf16 partials, rows of 2 d bytes,
    whatever the compute dtype, so their slope is per byte of those."""
    alpha, beta = _alpha_beta(min(timed["small"]), min(timed["large"]), row_bytes)
    shaped = {}
    if shape is not None:
        s_alpha, s_beta = _alpha_beta(statistics.fmean(timed["shaped_small"]), statistics.fmean(timed["shaped_large"]),
                                      shape.hidden * 2)
        shaped = dict(shaped_allreduce_s=s_alpha, shaped_allreduce_s_per_byte=s_beta,
                      median_shaped_allreduce_s=statistics.median(timed["shaped_small"]))
    return CollectiveCosts(tp=tp, pinned=pinned, allreduce_s=alpha, allreduce_s_per_byte=beta,
                           step_sync_s=min(timed["sync"]), median_allreduce_s=statistics.median(timed["small"]),
                           median_step_sync_s=statistics.median(timed["sync"]), **shaped)


def _alpha_beta(small_s: float, large_s: float, row_bytes: int) -> tuple[float, float]:
    """(seconds per call, seconds per byte) from a [1, d] and a [PREFILL_ROWS, d] call's seconds."""
    per_byte = max(0.0, (large_s - small_s) / ((PREFILL_ROWS - 1) * row_bytes))
    return max(0.0, small_s - row_bytes * per_byte), per_byte


def profile_section(model: str, dtype: str, compute_dtype: str | None, sizes: tuple[int, ...]) -> list[dict]:
    """A profile's `collectives` section: `measure_collectives` at each TP size in `sizes` for
    `model`'s activation rows (d x the compute dtype's bytes) and layer shape, pinned as a served
    worker is."""
    from pdserve.model.config import load_config
    from pdserve.model.default import resolve_model
    from pdserve.model.numerics import resolve_compute_dtype

    mc = load_config(resolve_model(model))
    row_bytes = mc.hidden_size * resolve_compute_dtype(dtype, compute_dtype).itemsize
    shape = LayerShape(mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.intermediate_size)
    return [measure_collectives(tp, row_bytes, shape=shape).to_dict() for tp in sizes]
