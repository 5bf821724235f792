"""What a TP engine's own steps say its collectives cost, against what the router would price
without them (router/pricing/live_collectives.py over engine/tp_tally.py, outside a server).

Runs prefills of two lengths one at a time and a decode batch on a TP N engine, folds rank 0's
tally into `LiveCollectives` as the router does, and prints per phase the measured all_reduce and
broadcast seconds per step, the live o(N, rows) = a + b rows + sync and the priced o from the
profile's collectives (`--profile FILE`) or the documented defaults, at a 512-token prefill and a
4-sequence decode step. With `--compare` it first runs the same work on a one-thread TP 1 engine
and prints the measured TP N / TP 1 step ratio (median 512-token prefill step, median 4-sequence
decode step, from the engines' step logs) beside the ratio `TpScaling.price` gives from the TP 1
step with the live collectives and with the profile's (the arms run one after the other).

    nice -n 19 .venv/bin/python scripts/tp_live_collectives.py --model /work/ckpt/llama107m --tp 2 --compare
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.step_log import StepLog, read_steps
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.live_collectives import LiveCollectives
from pdserve.router.pricing.tp_pricing import TpPricing, scaling_for
from pdserve.workers.heartbeat import collective_report


def run(model: str, tp: int, prefills: int, decode_tokens: int, log: Path):
    """The workload on a TP `tp` engine (one thread at TP 1) -> (its collective report, step records)."""
    engine = Engine(EngineConfig(model=model, tp=tp, num_blocks=256, num_threads=1 if tp == 1 else None))
    try:
        engine.generate([list(range(1, 65))], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        collective_report(engine)
        engine.step_log = StepLog(log)
        for i in range(prefills):
            for n in (128, 512):
                engine.generate([[(7 * i + 31 * n + j) % 250 + 1 for j in range(n)]], SamplingParams(max_tokens=1))
        prompts = [[(13 * k + j) % 250 + 1 for j in range(64)] for k in range(4)]
        engine.generate(prompts, SamplingParams(max_tokens=decode_tokens, ignore_eos=True))
        engine.step_log.close()
        return collective_report(engine), engine.model_config, read_steps([log])
    finally:
        engine.close()


def median_step(records, phase: str) -> float:
    if phase == "prefill":
        return statistics.median(r.seconds for r in records if r.new == (512,) and not r.batch)
    return statistics.median(r.seconds for r in records if r.batch == 4 and not r.new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--profile", help="a `pdserve profile` JSON whose collectives price the non-live side")
    ap.add_argument("--prefills", type=int, default=6, help="prefills of each length (128 and 512 tokens)")
    ap.add_argument("--decode-tokens", type=int, default=24, help="tokens each of 4 decoding sequences makes")
    ap.add_argument("--compare", action="store_true", help="also run TP 1 (one thread) and compare the step ratios")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run(args.model, 1, args.prefills, args.decode_tokens, Path(tmp, "tp1.jsonl")) if args.compare else None
        report, mc, records = run(args.model, args.tp, args.prefills, args.decode_tokens, Path(tmp, "tpn.jsonl"))
    profile = json.loads(Path(args.profile).read_text()) if args.profile else None
    pricing = TpPricing(CostModel(), scaling_for(mc, profile, 1))
    live = LiveCollectives(pricing)
    live.fold("w", args.tp, report)
    print(f"model {args.model}, TP {args.tp}")
    for phase, rows in (("prefill", 512), ("decode", 4)):
        window, costs = report.phase(phase), live.live_costs("w", phase)
        if window.steps == 0:  # no step of this phase (--decode-tokens 1: the prefill makes the one token)
            print(f"{phase}: no steps")
            continue
        priced = pricing.scaling.overhead(args.tp)
        print(f"{phase}: {window.steps} steps, {window.rows} rows, all_reduce {window.reduce_s / window.steps * 1e3:.2f} ms "
              f"and broadcast {window.broadcast_s / window.steps * 1e3:.2f} ms a step")
        if costs is None:
            continue
        o = pricing.scaling.overhead(args.tp, costs)
        print(f"  o({args.tp}, {rows}): live {o.step_s(0, rows) * 1e3:.2f} ms (a + sync {o.fixed_s * 1e3:.2f} ms, "
              f"b {o.per_row_s * 1e6:.2f} us a row); priced without it {priced.step_s(0, rows) * 1e3:.2f} ms")
        if base is not None:
            t1, tn = median_step(base[2], phase), median_step(records, phase)
            with_live = pricing.scaling.price(phase, args.tp, 1, costs).step_s(t1, rows) / t1
            without = pricing.scaling.price(phase, args.tp, 1).step_s(t1, rows) / t1
            print(f"  step TP 1 {t1 * 1e3:.1f} ms, TP {args.tp} {tn * 1e3:.1f} ms: measured ratio {tn / t1:.2f}, "
                  f"priced live {with_live:.2f} ({with_live / (tn / t1) - 1:+.0%}), "
                  f"priced from the profile {without:.2f} ({without / (tn / t1) - 1:+.0%})")


if __name__ == "__main__":
    main()
