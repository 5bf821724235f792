"""Prefill TTFT of a long prompt at TP 2 (two one-thread ranks, each pinned to its own core) vs
TP 1 (one process, two threads on the same two cores), with the all-reduce share of the TP 2 step.

Each arm lives in its own process for the whole run (a TP engine pins its process), built once;
every repeat sends both arms the same fresh random prompt (prefix cache off), in an order that
alternates repeat by repeat, and each arm times `generate(prompt, max_tokens=1)` (one prefill
step of the whole prompt, then the first token) in-process. The TP 2 arm also reports the wall
time rank 0 spent inside its all_reduce calls during that step (`TpLlamaModel.reduce_s`).

    .venv/bin/python scripts/tp_prefill_figure.py --model small --tokens 2040 --repeats 5
Prints one JSON object: per arm the TTFT samples and median, TP 2's all-reduce share, `uptime`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import time

CORES = (0, 1)


def arm_main(conn, model: str, dtype: str, tp: int, tokens: int) -> None:
    """One arm's process: build the engine, then time each prompt the parent sends."""
    os.sched_setaffinity(0, set(CORES))
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.sequence import SamplingParams

    cfg = EngineConfig(model=model, dtype=dtype, num_threads=2 if tp == 1 else 1, tp=tp,
                       tp_cores=CORES if tp > 1 else (), max_num_batched_tokens=tokens, enable_prefix_cache=False,
                       num_blocks=-(-tokens // 16) + 8, max_model_len=tokens + 8)
    engine = Engine(cfg)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([[5] * 64], params)  # warm-up
    conn.send("ready")
    while (prompt := conn.recv()) is not None:
        before = engine.model.reduce_s if tp > 1 else 0.0
        t0 = time.perf_counter()
        engine.generate([prompt], params)
        ttft = time.perf_counter() - t0
        conn.send((ttft, (engine.model.reduce_s - before) if tp > 1 else 0.0))
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=2040)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    arms = {}
    for tp in (1, 2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=arm_main, args=(child, args.model, args.dtype, tp, args.tokens))
        proc.start()
        arms[tp] = (parent, proc)
    for parent, _ in arms.values():
        assert parent.recv() == "ready"
    samples = {1: [], 2: []}
    reduce_share = []
    rng = random.Random(0)
    for rep in range(args.repeats):
        prompt = [rng.randrange(3, 250) for _ in range(args.tokens)]
        for tp in ((1, 2) if rep % 2 == 0 else (2, 1)):
            arms[tp][0].send(prompt)
            ttft, reduce_s = arms[tp][0].recv()
            samples[tp].append(ttft)
            if tp == 2:
                reduce_share.append(reduce_s / ttft)
            time.sleep(0.3)
    for parent, proc in arms.values():
        parent.send(None)
        proc.join(30)
    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "prompt_tokens": args.tokens, "repeats": args.repeats,
        "tp1_2threads_ttft_s": samples[1], "tp2_pinned_ttft_s": samples[2],
        "tp1_median_s": statistics.median(samples[1]), "tp2_median_s": statistics.median(samples[2]),
        "tp2_over_tp1": statistics.median(samples[2]) / statistics.median(samples[1]),
        "tp2_allreduce_share": reduce_share, "tp2_allreduce_share_median": statistics.median(reduce_share),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }, indent=1))


if __name__ == "__main__":
    main()
