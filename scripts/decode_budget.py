"""Decode step time against the sum of its parts measured alone (issue 23's "engine overhead" figure).

Usage: .venv/bin/python scripts/decode_budget.py --model CKPT [--batch 32] [--context 512]
       [--threads 2] [--rounds 5] [--no-batch-invariant]

Three arms, interleaved in every round (the machine is shared, so each round measures all three):
  step  - one engine decode step of `batch` sequences with `context` tokens of K/V (engine.step());
  gemms - every product of that step alone (the model's own prepared weights and `linear`, the
          same [batch, d] inputs: fused q|k|v, o, fused gate|up, down per layer, then the LM head);
  attn  - SDPA over contiguous K/V [batch, H_kv, context + 1, D] (G query heads per K/V head), per layer;
  kernel - (extra) the engine's own paged decode kernel over a pool of random blocks, per layer.
Prints one JSON line: medians in ms, step / (gemms + attn) (the issue's figure) and
step / (gemms + kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine.speed.bench_arms import import_contexts
from pdserve.engine.speed import step_parts
from pdserve.engine.speed.benchmark import _prompts
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model import paged_decode


def _attention(model, batch: int, context: int):
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    q = torch.randn(batch, cfg.num_kv_heads, group, cfg.head_dim).to(model.dtype)  # [Bd, H_kv, G, D]
    kv = [torch.randn(2, batch, cfg.num_kv_heads, context + 1, cfg.head_dim).to(model.dtype)
          for _ in range(cfg.num_layers)]  # per layer [2, Bd, H_kv, C, D], contiguous

    def run():
        for layer_kv in kv:
            F.scaled_dot_product_attention(q, layer_kv[0], layer_kv[1], scale=cfg.head_dim ** -0.5)
    return run


def _kernel(model, batch: int, context: int, block: int = 16):
    cfg = model.config
    width = -(-(context + 1) // block)
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(2, batch * width + 8, block, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(model.dtype)
             for _ in range(cfg.num_layers)]  # per layer [2, N, B, H_kv, D]
    tables = torch.randperm(batch * width + 8, generator=gen)[: batch * width].view(batch, width)  # [Bd, M]
    lens = torch.full((batch,), context + 1, dtype=torch.int64)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim).to(model.dtype)  # [Bd, H_q, D]

    def run():
        for pool in pools:
            paged_decode.decode_attention(q, pool[0], pool[1], tables, lens)
    return run


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--no-batch-invariant", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = args.rounds * args.reps + 2
    engine = Engine(EngineConfig(model=args.model, batch_invariant=not args.no_batch_invariant,
                                 enable_prefix_cache=False, max_num_seqs=args.batch, kv_cache_bytes=0,
                                 num_blocks=args.batch * (args.context + steps + 64) // 16 + 64))
    import_contexts(engine, _prompts(args.batch, args.context, engine.model_config.vocab_size, 2), steps)
    arms = {"step": engine.step, "gemms": step_parts.products(engine.model, args.batch, args.batch)[0],
            "attn": _attention(engine.model, args.batch, args.context),
            "kernel": _kernel(engine.model, args.batch, args.context)}
    with torch.inference_mode():
        for fn in arms.values():
            fn()
        times = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, fn in arms.items():
                times[name].append(_time(fn, args.reps))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(json.dumps({"cpu": engine.numerics["kind"], "products": engine.numerics["products"],
                      "threads": args.threads, "batch": args.batch, "context": args.context,
                      "median_ms": med, "runs_ms": times,
                      "step_over_parts": med["step"] / (med["gemms"] + med["attn"]),
                      "step_over_gemms_and_kernel": med["step"] / (med["gemms"] + med["kernel"])}))


if __name__ == "__main__":
    main()
