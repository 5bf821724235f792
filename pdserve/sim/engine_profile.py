"""Measure our own engine on this machine and fit a profiled latency model (`pdserve profile`).

Contract: prefill time is measured per prompt length (one fresh request, prefix cache off,
the whole prompt in one step, or in `chunk_tokens` chunks like a server with that step budget),
decode step time per (batch, context) point (the batch first prefilled, then `DECODE_STEPS`
steps timed); each point is the median of `repeats` timings after one warm-up. The engine takes
the server's numerics flags (dtype, compute dtype, batch invariance). The fit is
`profiled.fit_profile`; the JSON records the engine config, the thread count and every raw
point; K/V capacity is that of a serving worker with `kv_cache_mb` of pool in the engine's own
K/V dtype. Timing mirrors `pdserve.engine.benchmark`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from pdserve.sim.profiled import ProfiledLatency, fit_profile

DECODE_STEPS = 4


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

    @classmethod
    def quick(cls, model: str = "tiny", threads: int | None = None, dtype: str = "bfloat16") -> ProfilePlan:
        return cls(model=model, prompt_lens=(16, 48, 96), batches=(1, 4), contexts=(16, 64), repeats=2, threads=threads,
                   dtype=dtype)


def _engine(plan: ProfilePlan):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine

    longest = max(max(plan.prompt_lens), max(plan.contexts) + DECODE_STEPS * (plan.repeats + 2) + 4)
    blocks = max(plan.batches) * (longest // 16 + 2) + 64
    budget = plan.chunk_tokens or longest * max(plan.batches)
    config = EngineConfig(model=plan.model, dtype=plan.dtype, compute_dtype=plan.compute_dtype,
                          batch_invariant=plan.batch_invariant, enable_prefix_cache=False, num_blocks=blocks,
                          max_num_seqs=max(plan.batches), max_num_batched_tokens=budget, num_threads=plan.threads)
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


def decode_point_s(engine, batch: int, context: int, repeats: int) -> tuple[int, float]:
    """(mean visible context summed over the batch, seconds per decode step)."""
    from pdserve.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=DECODE_STEPS * (repeats + 1) + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{context}-{i}", _prompt(context, i), params)
    while any(not s.is_decoding for s in engine.seqs.values()):
        engine.step()
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for _ in range(DECODE_STEPS):
            engine.step()
        times.append((time.perf_counter() - started) / DECODE_STEPS)
    for rid in list(engine.seqs):
        engine.abort(rid)
    mid_context = context + 1 + DECODE_STEPS * (repeats + 1) // 2
    return batch * mid_context, statistics.median(times[1:])


def run_profile(plan: ProfilePlan) -> ProfiledLatency:
    """Measure every point of `plan` and fit the profiled latency model."""
    import torch

    if plan.threads:
        torch.set_num_threads(plan.threads)
    engine = _engine(plan)
    prefill = [(n, prefill_point_s(engine, n, plan.repeats)) for n in plan.prompt_lens]
    decode = []
    for b in plan.batches:
        for c in plan.contexts:
            ctx, seconds = decode_point_s(engine, b, c, plan.repeats)
            decode.append((b, ctx, seconds))
    engine.assert_no_leaks()
    cfg = engine.config
    per_token = engine.abi.bytes_per_token  # the pool's own dtype
    meta = {"kv_cache_mb": plan.kv_cache_mb, "model": plan.model, "dtype": cfg.dtype, "compute_dtype": cfg.compute_dtype,
            "batch_invariant": cfg.batch_invariant, "chunk_tokens": plan.chunk_tokens,
            "threads": torch.get_num_threads(), "block_size": cfg.block_size}
    # Capacity is that of a serving engine with `kv_cache_mb` of K/V pool, not of this small pool.
    return fit_profile(prefill, decode, meta=meta, kv_bytes_per_token=per_token,
                       kv_capacity_tokens=(plan.kv_cache_mb << 20) // per_token)
