"""Check the router's TP pricing formula against measurement (docs/tensor_parallel.md, Pricing).

Profiles the engine at TP 1 (`--threads` threads) and at TP N (N one-thread ranks), each in its
own process as `pdserve profile` does, then prints per phase the measured time ratio TP N / TP 1
at one reference point of each fit (a `--prompt`-token prefill; a decode step of `--batch`
sequences at `--context` tokens) beside the ratio latency/tp_scaling.py prices from the TP 1
profile and the collectives the TP 1 run measured at TP N (`pdserve profile --collectives-tp N`),
as priced (`priced_ratio`: the engine-shaped all_reduce, products between the calls,
latency/tp_collectives.py) and with the back-to-back floor instead (`priced_ratio_back_to_back`).
Take it on a quiet machine: the ratio of two noisy timings is noisier still.

    .venv/bin/python scripts/tp_pricing_check.py --model /work/ckpt/llama107m --threads 2 --tp 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from pdserve.latency.profiled import ProfiledLatency
from pdserve.model.config import load_config
from pdserve.model.default import resolve_model
from pdserve.router.pricing.tp_pricing import scaling_for


def profile(model: str, threads: int, tp: int, collectives_tp: int, out: Path, quick: bool) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "profile", "--model", model, "--threads", str(threads), "--tp", str(tp),
           "--collectives-tp", str(collectives_tp), "--out", str(out)] + (["--quick"] if quick else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/ckpt/llama107m")
    ap.add_argument("--threads", type=int, default=2, help="a TP 1 worker's threads")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="pdserve profile --quick (a smoke run, not a figure)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw_one = profile(args.model, args.threads, 1, args.tp, Path(tmp) / "tp1.json", args.quick)
        raw_many = profile(args.model, 1, args.tp, args.tp, Path(tmp) / "tpn.json", args.quick)
    one, many = ProfiledLatency.from_dict(raw_one), ProfiledLatency.from_dict(raw_many)
    scaling = scaling_for(load_config(resolve_model(args.model)), raw_one, args.threads)
    context = args.batch * args.context
    measured = {"prefill": (one.prefill_batch_s([args.prompt], [0]), many.prefill_batch_s([args.prompt], [0]), args.prompt),
                "decode": (one.decode_step_s(args.batch, context), many.decode_step_s(args.batch, context), args.batch)}
    print(json.dumps({"collectives_at_tp1_run": raw_one["collectives"], "collectives_at_tpn_run": raw_many["collectives"]}))
    # the back-to-back all_reduce floor in place of the engine-shaped one the pricing reads
    floor = replace(scaling, collectives=tuple(replace(c, shaped_allreduce_s=None) for c in scaling.collectives))
    for phase, (t1, tn, rows) in measured.items():
        price, floor_price = scaling.price(phase, args.tp), floor.price(phase, args.tp)
        print(json.dumps({"phase": phase, "tp": args.tp, "threads_at_tp1": args.threads, "tp1_s": round(t1, 5),
                          "tpn_s": round(tn, 5), "measured_ratio": round(tn / t1, 4),
                          "priced_ratio": round(price.step_s(t1, rows) / t1, 4), "compute_factor": round(price.factor, 4),
                          "collectives_s": round(price.fixed_s + price.per_row_s * rows, 5),
                          "priced_ratio_back_to_back": round(floor_price.step_s(t1, rows) / t1, 4),
                          "collectives_s_back_to_back": round(floor_price.fixed_s + floor_price.per_row_s * rows, 5)}))


if __name__ == "__main__":
    main()
