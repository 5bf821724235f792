"""Where a TP step's time goes on rank 0, in CPU time as well as wall (docs/tensor_parallel.md, Pricing).

Builds one engine (`--tp` ranks of one thread, or TP 1 with `--threads`) as `pdserve profile`
does and times, per phase, the median over `--repeats` (after one warm-up) of one step: a
`--prompt`-token prefill and a decode step of `--batch` sequences at `--context` tokens. Per step
it prints rank 0's wall time, its main thread's CPU time (`time.thread_time`: what the step itself
computed, whatever the machine's load), the whole process's CPU time, and at TP > 1 the wall time
inside the all_reduces (`TpLlamaModel.reduce_s`, with their count) and inside the step broadcast.
On a loaded machine the wall figures are mostly waiting; the CPU figures are the step's work.

    .venv/bin/python scripts/tp_step_components.py --model /work/ckpt/llama107m --tp 2
    .venv/bin/python scripts/tp_step_components.py --model /work/ckpt/llama107m --tp 1 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pdserve.engine.tp_group as tp_group
from pdserve.engine.sequence import SamplingParams
from pdserve.latency import engine_profile

BROADCAST = {"s": 0.0}


def _timed_broadcast(original):
    def broadcast(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            BROADCAST["s"] += time.perf_counter() - t0
    return broadcast


def _clocks(shard) -> dict[str, float]:
    return {"wall_ms": time.perf_counter(), "thread_cpu_ms": time.thread_time(), "process_cpu_ms": time.process_time(),
            "allreduce_wall_ms": getattr(shard, "reduce_s", 0.0), "allreduces": getattr(shard, "num_reduces", 0),
            "broadcast_wall_ms": BROADCAST["s"]}


def _one_step(engine, shard, phase: str, args, k: int) -> dict[str, float]:
    """Clocks of one step of `phase` (ms; the all_reduce count as it is)."""
    if phase == "prefill":
        engine.add_request(f"p{k}", engine_profile._prompt(args.prompt, k), SamplingParams(max_tokens=1, ignore_eos=True))
    else:
        engine_profile._import_batch(engine, args.batch, args.context, f"c{k}")
        engine.step()  # the batch's first step, untimed
    before = _clocks(shard)
    engine.step()
    after = _clocks(shard)
    for rid in list(engine.seqs):
        engine.abort(rid)
    return {key: (after[key] - before[key]) * (1e3 if key.endswith("_ms") else 1) for key in before}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/ckpt/llama107m")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (TP 1 only; each TP rank has one)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tp_group.dist.broadcast_object_list = _timed_broadcast(tp_group.dist.broadcast_object_list)
    threads = args.threads if args.tp == 1 else 1
    plan = engine_profile.ProfilePlan(model=args.model, threads=threads, tp=args.tp, prompt_lens=(args.prompt,),
                                      batches=(args.batch,), contexts=(args.context,))
    import torch

    torch.set_num_threads(threads)
    engine = engine_profile._engine(plan)
    shard = getattr(engine.model, "shard", None)
    try:
        for phase in ("prefill", "decode"):
            steps = [_one_step(engine, shard, phase, args, k) for k in range(args.repeats + 1)][1:]
            median = {key: round(statistics.median(s[key] for s in steps), 3) for key in steps[0]}
            print(json.dumps({"phase": phase, "tp": args.tp, "threads": threads, **median}))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
