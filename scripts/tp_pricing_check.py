"""Check the router's TP pricing formula against measurement (docs/tensor_parallel.md, Pricing).

Profiles the engine at TP 1 (`--threads` threads) and at TP N (N one-thread ranks), each in its
own process as `pdserve profile` does, then prints per phase the measured time ratio TP N / TP 1
at one reference point of each fit (a `--prompt`-token prefill; a decode step of `--batch`
sequences at `--context` tokens) beside the ratio latency/tp_scaling.py prices. Take it on a
quiet machine: the ratio of two noisy timings is noisier still.

    .venv/bin/python scripts/tp_pricing_check.py --model /work/ckpt/llama107m --threads 2 --tp 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.latency.profiled import ProfiledLatency
from pdserve.latency.tp_scaling import model_scaling
from pdserve.model.config import load_config
from pdserve.model.default import resolve_model


def profile(model: str, threads: int, tp: int, out: Path, quick: bool) -> ProfiledLatency:
    cmd = [sys.executable, "-m", "pdserve.cli", "profile", "--model", model, "--threads", str(threads), "--tp", str(tp),
           "--out", str(out)] + (["--quick"] if quick else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return ProfiledLatency.from_dict(json.loads(out.read_text()))


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
        one = profile(args.model, args.threads, 1, Path(tmp) / "tp1.json", args.quick)
        many = profile(args.model, 1, args.tp, Path(tmp) / "tpn.json", args.quick)
    scaling = model_scaling(load_config(resolve_model(args.model)), args.threads)
    measured = {
        "prefill": many.prefill_batch_s([args.prompt], [0]) / one.prefill_batch_s([args.prompt], [0]),
        "decode": many.decode_step_s(args.batch, args.batch * args.context) / one.decode_step_s(args.batch, args.batch * args.context),
    }
    for phase, ratio in measured.items():
        print(json.dumps({"phase": phase, "tp": args.tp, "threads_at_tp1": args.threads, "measured_ratio": round(ratio, 4),
                          "priced_ratio": round(scaling.factor(phase, args.tp), 4)}))


if __name__ == "__main__":
    main()
