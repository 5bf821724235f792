"""Measure our own engine on this machine and fit a profiled latency model (`pdserve profile`).

Contract: prefill time is measured per prompt length (one fresh request, prefix cache off,
the whole prompt in one step, or in `chunk_tokens` chunks like a server with that step budget),
decode step time per (batch, context) point; a prefill point is the median of `repeats` timings
after one warm-up. A decode point's batch is admitted with its context already in K/V (the
handoff's import path, no prefill), and the points are timed in `DECODE_WARMUP_ROUNDS + repeats`
passes over all of them, a point's time being the median of its passes after the warm-up ones
(`decode_points_s`). Timing one point after another let a slow spell of a few seconds set a
whole point: a profile taken that way had a 3-row step cheaper than a 2-row one and 16 rows at
1,043 tokens each cheaper than at 137. The engine takes
the server's numerics flags (dtype, compute dtype, batch invariance). The fit is
`profiled.fit_profile`; the JSON records the engine config, the thread count and every raw
point; K/V capacity is that of a serving worker with `kv_cache_mb` of pool in the engine's own
K/V dtype. Timing mirrors `pdserve.engine.speed.benchmark`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from pdserve.latency.profiled import ProfiledLatency, fit_profile

DECODE_STEPS = 4
DECODE_WARMUP_ROUNDS = 1


@dataclass(frozen=True)
class ProfilePlan:
    """Which points to measure; `quick` is sized for tests on the tiny model."""

    model: str = "small"
    prompt_lens: tuple[int, ...] = (64, 128, 256, 512)
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (64, 256)
    repeats: int = 3
    threads: int | None = None
    dtype: str = "bfloat16"  # match the server's `--dtype` (float32 is much faster on CPUs without bf16)
    compute_dtype: str | None = None  # match the server's `--compute-dtype`
    batch_invariant: bool = True  # match the server's `--no-batch-invariant`
    chunk_tokens: int | None = None  # prefill in chunks of this many tokens, as a server with this budget does
    kv_cache_mb: int = 256  # the K/V pool a server would give each worker (`pdserve serve --kv-cache-mb`)
    block_size: int = 16  # match the server's `--block-size` (the attention kernels walk the pool by block)
    tp: int = 1  # tensor-parallel ranks, one thread each, unpinned (a TP worker's steps; recorded as meta.tp)

    @classmethod
    def quick(cls, model: str = "tiny", threads: int | None = None, dtype: str = "bfloat16") -> ProfilePlan:
        return cls(model=model, prompt_lens=(16, 48, 96), batches=(1, 4), contexts=(16, 64), repeats=2, threads=threads,
                   dtype=dtype)


def _engine(plan: ProfilePlan):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine

    longest = max(max(plan.prompt_lens), max(plan.contexts) + DECODE_STEPS + 4)
    blocks = max(plan.batches) * (longest // plan.block_size + 2) + 64
    budget = plan.chunk_tokens or longest * max(plan.batches)
    config = EngineConfig(model=plan.model, dtype=plan.dtype, compute_dtype=plan.compute_dtype,
                          batch_invariant=plan.batch_invariant, enable_prefix_cache=False, num_blocks=blocks,
                          max_num_seqs=max(plan.batches), max_num_batched_tokens=budget, num_threads=plan.threads,
                          tp=plan.tp, block_size=plan.block_size)
    return Engine(config)


def _prompt(n: int, seed: int) -> list[int]:
    return [97 + (seed * 7919 + k * 31) % 26 for k in range(n)]


def prefill_point_s(engine, prompt_len: int, repeats: int) -> float:
    from pdserve.engine.sequence import SamplingParams

    times = []
    for r in range(repeats + 1):
        engine.add_request(f"p{prompt_len}-{r}", _prompt(prompt_len, r), SamplingParams(max_tokens=1, ignore_eos=True))
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _import_batch(engine, batch: int, context: int, tag: str) -> None:
    """Admit `batch` sequences whose `context` prompt tokens are already in K/V, as a decode
    worker admits a handoff: the timing of a decode step does not depend on the K/V values, so
    the pool's blocks are taken as they are instead of prefilling `batch * context` tokens."""
    from pdserve.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=DECODE_STEPS + 3, ignore_eos=True)
    for i in range(batch):
        rid, prompt = f"d{tag}-{i}", _prompt(context, i)
        engine.reserve_import(rid, prompt, params)
        engine.commit_import(rid, prompt, prompt[-1], params, seed=i)


def decode_points_s(engine, points: list[tuple[int, int]], repeats: int) -> list[tuple[int, int, float]]:
    """(batch, visible context summed, seconds per decode step) per (batch, context) point.

    The points are measured in passes, each pass timing every point once (one untimed step on
    the fresh batch, then `DECODE_STEPS` timed), and a point's time is the median over the
    passes after `DECODE_WARMUP_ROUNDS`: on a shared machine a slow spell then lands on one
    pass of many points, not on every timing of one point."""
    times: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for round_ in range(DECODE_WARMUP_ROUNDS + repeats):
        for batch, context in points:
            _import_batch(engine, batch, context, f"{batch}-{context}-{round_}")
            engine.step()  # the first step of a new batch shape runs slow
            started = time.perf_counter()
            for _ in range(DECODE_STEPS):
                engine.step()
            times[(batch, context)].append((time.perf_counter() - started) / DECODE_STEPS)
            for rid in list(engine.seqs):
                engine.abort(rid)
    # timed step k (1..DECODE_STEPS) of a sequence attends over context + 1 + k tokens
    mid = lambda c: round(c + 1 + (DECODE_STEPS + 1) / 2)  # noqa: E731
    return [(b, b * mid(c), statistics.median(times[(b, c)][DECODE_WARMUP_ROUNDS:])) for b, c in points]


def run_profile(plan: ProfilePlan) -> ProfiledLatency:
    """Measure every point of `plan` and fit the profiled latency model."""
    import torch

    if plan.threads:
        torch.set_num_threads(plan.threads)
    engine = _engine(plan)
    try:
        prefill = [(n, prefill_point_s(engine, n, plan.repeats)) for n in plan.prompt_lens]
        decode = decode_points_s(engine, [(b, c) for b in plan.batches for c in plan.contexts], plan.repeats)
        engine.assert_no_leaks()
    finally:
        engine.close()  # a TP engine's followers stop
    cfg = engine.config
    per_token = engine.abi.bytes_per_token  # the pool's own dtype
    meta = {"kv_cache_mb": plan.kv_cache_mb, "model": plan.model, "dtype": cfg.dtype, "compute_dtype": cfg.compute_dtype,
            "batch_invariant": cfg.batch_invariant, "chunk_tokens": plan.chunk_tokens,
            "threads": torch.get_num_threads(), "block_size": cfg.block_size, "tp": plan.tp}
    # Capacity is that of a serving engine with `kv_cache_mb` of K/V pool, not of this small pool.
    return fit_profile(prefill, decode, meta=meta, kv_bytes_per_token=per_token,
                       kv_capacity_tokens=(plan.kv_cache_mb << 20) // per_token)
