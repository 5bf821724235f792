"""Profile one engine decode step (batch x context) and one prefill with torch.profiler.

Usage: .venv/bin/python scripts/profile_engine.py --model CKPT [--batch 32] [--context 512]
       [--threads 2] [--no-batch-invariant] [--steps 5]
Prints wall ms per step and the top operators by self CPU time (share of the profiled total).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.speed.bench_arms import import_contexts
from pdserve.engine.speed.benchmark import _prompts
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams


def _table(prof, steps: int, top: int) -> str:
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    lines = [f"{'op':<44}{'ms/step':>9}{'share':>8}{'calls/step':>11}"]
    for e in rows:
        lines.append(f"{e.key[:43]:<44}{e.self_cpu_time_total / 1e3 / steps:>9.2f}"
                     f"{e.self_cpu_time_total / total:>8.1%}{e.count / steps:>11.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-batch-invariant", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, batch_invariant=not args.no_batch_invariant,
                                 enable_prefix_cache=False, max_num_seqs=args.batch, kv_cache_bytes=0,
                                 num_blocks=args.batch * (args.context + 128) // 16 + 64,
                                 max_num_batched_tokens=args.context))
    print(engine.numerics["kind"], engine.numerics["products"], "threads", torch.get_num_threads())
    import_contexts(engine, _prompts(args.batch, args.context, engine.model_config.vocab_size, 2), args.steps + 4)
    for _ in range(2):
        engine.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(f"decode batch {args.batch} x {args.context}: {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms/step (profiled)")
    print(_table(prof, args.steps, args.top))
    for rid in list(engine.seqs):
        engine.abort(rid)
    prompts = _prompts(3, args.context, engine.model_config.vocab_size, 7)
    engine.add_request("warm", prompts[0], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, prompt in enumerate(prompts[1:]):
            engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
    print(f"prefill {args.context}: {(time.perf_counter() - t0) / 2 * 1e3:.1f} ms (profiled)")
    print(_table(prof, 2, args.top))


if __name__ == "__main__":
    main()
