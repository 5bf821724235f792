"""A prompt's prefill against its products alone and the products' ceiling on this CPU: how much of
a TTFT any change outside the bf16 products could still remove (issue 39's TTFT figure).

Usage: .venv/bin/python scripts/prefill_budget.py --model CKPT [--prompt 512] [--threads 2] [--rounds 5]

Three arms, interleaved in every round:
  prefill  - the engine's prefill of a fresh `prompt`-token prompt to its first token (prefix cache off);
  products - every product of that prefill alone: the model's own prepared weights and `linear` on
             [prompt, d] inputs (fused q|k|v, o, fused gate|up, down per layer; the LM head's one row);
  ceiling  - one 2048 x 2048 x 2048 bf16 product through torch (oneDNN where the CPU has bf16 dot
             products), the rate a large product reaches here.
Prints one JSON line: medians in ms, the products' GFLOP/s and the ceiling's, and products / prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.speed import step_parts
from pdserve.engine.speed.benchmark import _prompts


def _prefill(engine: Engine, prompts: list[list[int]]):
    count = iter(range(10**9))

    def run():
        i = next(count)
        engine.add_request(f"p{i}", prompts[i % len(prompts)], SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, enable_prefix_cache=False, max_num_seqs=4, kv_cache_bytes=0,
                                 num_blocks=4 * (args.prompt + 16) // 16 + 64, max_num_batched_tokens=args.prompt))
    products, flops = step_parts.products(engine.model, args.prompt, 1)
    a, b = torch.randn(2048, 2048).to(torch.bfloat16), torch.randn(2048, 2048).to(torch.bfloat16)
    arms = {"prefill": _prefill(engine, _prompts(args.rounds + 1, args.prompt, engine.model_config.vocab_size, 7)),
            "products": products, "ceiling": lambda: F.linear(a, b)}
    times = {name: [] for name in arms}
    with torch.inference_mode():
        for fn in arms.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(json.dumps({"cpu": engine.numerics["kind"], "products_plan": engine.numerics["products"],
                      "threads": args.threads, "prompt": args.prompt, "median_ms": med, "runs_ms": times,
                      "products_gflops": flops / med["products"] / 1e6,
                      "ceiling_gflops": 2 * 2048**3 / med["ceiling"] / 1e6,
                      "products_over_prefill": med["products"] / med["prefill"]}))


if __name__ == "__main__":
    main()
