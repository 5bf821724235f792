"""Time a decode step's bf16 products alone, per product path and row count (docs/engine_speed.md §11, §12).

Usage: .venv/bin/python scripts/product_rows.py [--rows 1,2,4,8] [--arms onednn,matched,kernel,flinear]
       [--threads 2] [--rounds 30] [--clock wall|thread|process] [--reuse]

The products are the 107M checkpoint's 48 of one decode step without the LM head: 12 layers of
fused q|k|v [1280, 768], o [768, 768], fused gate|up [6144, 768] and down [768, 3072], random bf16
weights (208 MB; with --reuse the 4 weights of one layer serve all 12, so they stay in L3).
Arms, each over its own prepared copy of the same weights:
  onednn  - oneDNN's packed product (`onednn_packed.PackedWeight`, what F.linear runs, packed once);
  matched - `matched_gemv.MatchedWeight` (1-8 rows; its block size found at load as the engine does);
  kernel  - `bf16_gemm.KernelWeight` (the "kernel" plan);
  flinear - bf16 `F.linear` on the plain weight.
An arm this machine cannot run (no oneDNN bf16 packing, no AVX512-BF16 build, no C compiler) is
reported as unavailable. Every round times every (rows, arm) once, the arms in alternating order
(reversed every other round), and prints one JSON object: per arm and row count the median and
minimum in ms of one step's 48 products, with the clock, thread count and `cpu` report.
--clock wall is time.perf_counter; thread is time.thread_time (the calling thread's CPU);
process is time.process_time (every thread's CPU, OpenMP's spin-waiting included).
Written from the description of the product timings docs/engine_speed.md quotes (the scripts
those were first measured with were not kept); re-run it to check them on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.model import bf16_gemm, onednn_packed
from pdserve.model.cpu import cpu_report
from pdserve.model.matched_gemv import ROWS_MAX, MatchedWeight

SHAPES = ((1280, 768), (768, 768), (6144, 768), (768, 3072))  # [N, K] per layer: q|k|v, o, gate|up, down
LAYERS = 12
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}


def _weights(reuse: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    layer = lambda: [(torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16) for n, k in SHAPES]
    one = layer()
    return [w for _ in range(LAYERS) for w in (one if reuse else layer())]  # [48] of [N, K]


def _prepare(arm: str, weights: list[torch.Tensor]):
    """One callable x -> x @ w.T per weight, or None where this machine cannot run the arm."""
    if arm == "flinear":
        return [lambda x, w=w: F.linear(x, w) for w in weights]
    if arm == "onednn":
        return [onednn_packed.PackedWeight(w) for w in weights] if onednn_packed.available() else None
    if arm == "kernel":
        return [bf16_gemm.KernelWeight(w) for w in weights] if bf16_gemm.available() else None
    if arm == "matched":
        built = [MatchedWeight.build(w) for w in weights]
        return None if any(m is None for m in built) else [m.product for m in built]
    raise ValueError(f"unknown arm {arm!r}")


def _step(fns, inputs: dict[int, torch.Tensor], clock) -> float:
    """ms for the 48 products on the given [rows, K] inputs."""
    t0 = clock()
    for fn, k in zip(fns, [k for _ in range(LAYERS) for _, k in SHAPES]):
        if fn(inputs[k]) is None:
            raise RuntimeError("the matched kernel refused the rows (more than ROWS_MAX or a changed thread count)")
    return (clock() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--arms", default="onednn,matched,kernel,flinear")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--reuse", action="store_true", help="the 4 weights of one layer serve all 12 (L3-resident)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    weights = _weights(args.reuse)
    arms = {arm: _prepare(arm, weights) for arm in args.arms.split(",")}
    runnable = [arm for arm, fns in arms.items() if fns is not None]
    gen = torch.Generator().manual_seed(1)
    inputs = {rows: {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
              for rows in rows_list}
    times: dict[tuple[str, int], list[float]] = {}
    for arm in runnable:  # warm-up: first calls, the caches of the packed layouts
        for rows in rows_list:
            if arm != "matched" or rows <= ROWS_MAX:
                _step(arms[arm], inputs[rows], CLOCKS[args.clock])
    for r in range(args.rounds):
        order = runnable if r % 2 == 0 else runnable[::-1]
        for rows in rows_list:
            for arm in order:
                if arm == "matched" and rows > ROWS_MAX:
                    continue
                times.setdefault((arm, rows), []).append(_step(arms[arm], inputs[rows], CLOCKS[args.clock]))
    report = {"cpu": {k: cpu_report()[k] for k in ("kind", "model", "isa_caps")}, "threads": args.threads,
              "clock": args.clock, "rounds": args.rounds, "reuse": args.reuse,
              "unavailable": [arm for arm, fns in arms.items() if fns is None],
              "ms": {f"{arm}@{rows}": {"median": round(statistics.median(v), 3), "min": round(min(v), 3)}
                     for (arm, rows), v in sorted(times.items())}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
