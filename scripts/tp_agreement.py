"""How often TP 2 and TP 1 agree token for token, per dtype (docs/tensor_parallel.md).

Greedy continuations of the same prompts from a TP 1 engine and a TP 2 engine (two one-thread
ranks) over one checkpoint; prints, per dtype, the streams that are equal, the first position
where each other stream diverges, and the largest prefill-logit difference.

    .venv/bin/python scripts/tp_agreement.py --model /work/ckpt/llama107m --prompts 8 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.runner import build_batch
from pdserve.engine.scheduler import StepPlan
from pdserve.engine.sequence import SamplingParams, Sequence


def last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    seq = Sequence("probe", tuple(prompt), SamplingParams(), seed=0)
    seq.block_table = engine.blocks.allocate(-(-len(prompt) // engine.abi.block_size))
    batch = build_batch(StepPlan(prefill=[(seq, len(prompt))]), engine.abi.block_size)
    out = engine.model.forward(batch.token_ids, batch.positions, batch.meta, engine.pool.tensor, batch.logits_rows)
    engine.blocks.release(seq.block_table)
    return out[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/ckpt/llama107m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(16, 200))] for _ in range(args.prompts)]
    report = {}
    for dtype in ("float32", "bfloat16"):
        engines = [Engine(EngineConfig(model=args.model, dtype=dtype, num_blocks=512, tp=tp, num_threads=1))
                   for tp in (1, 2)]
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        outs = [[list(o.output_ids) for o in e.generate(prompts, params)] for e in engines]
        diverge = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(*outs)]
        logit_diff = max(float((last_logits(engines[0], p) - last_logits(engines[1], p)).abs().max()) for p in prompts)
        report[dtype] = {"equal_streams": sum(d is None for d in diverge), "streams": len(prompts),
                         "first_divergence": [d for d in diverge if d is not None],
                         "max_abs_prefill_logit_diff": logit_diff}
        engines[1].close()
    print(json.dumps({"model": args.model, "tokens": args.tokens, **report}, indent=1))


if __name__ == "__main__":
    main()
