"""What a TP engine's own steps say its collectives cost, against what the router would price
without them (router/live_collectives.py over engine/tp_tally.py, outside a server).

Runs prefills of two lengths one at a time and a decode batch on a TP N engine, folds rank 0's
tally into `LiveCollectives` as the router does, and prints per phase the measured all_reduce and
broadcast seconds per step, the live o(N, rows) = a + b rows + sync and the priced o from the
profile's collectives (`--profile FILE`) or the documented defaults, at a 512-token prefill and a
4-sequence decode step.

    nice -n 19 .venv/bin/python scripts/tp_live_collectives.py --model /work/ckpt/llama107m --tp 2
"""

from __future__ import annotations

import argparse
import json
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.router.cost import CostModel
from pdserve.router.live_collectives import LiveCollectives
from pdserve.router.tp_pricing import TpPricing, scaling_for
from pdserve.workers.heartbeat import collective_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--profile", help="a `pdserve profile` JSON whose collectives price the non-live side")
    ap.add_argument("--prefills", type=int, default=6, help="prefills of each length (128 and 512 tokens)")
    ap.add_argument("--decode-tokens", type=int, default=24, help="tokens each of 4 decoding sequences makes")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, tp=args.tp, num_blocks=256))
    try:
        engine.generate([list(range(1, 65))], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        collective_report(engine)
        t0 = time.perf_counter()
        for i in range(args.prefills):
            for n in (128, 512):
                engine.generate([[(7 * i + j) % 250 + 1 for j in range(n)]], SamplingParams(max_tokens=1))
        prompts = [[(13 * k + j) % 250 + 1 for j in range(64)] for k in range(4)]
        engine.generate(prompts, SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
        report, wall_s = collective_report(engine), time.perf_counter() - t0
    finally:
        engine.close()
    profile = json.load(open(args.profile)) if args.profile else None
    pricing = TpPricing(CostModel(), scaling_for(engine.model_config, profile, 1))
    live = LiveCollectives(pricing)
    live.fold("w", args.tp, report)
    print(f"model {args.model}, TP {args.tp}, {wall_s:.1f} s of steps")
    for phase, rows in (("prefill", 512), ("decode", 4)):
        window, costs = report.phase(phase), live.live_costs("w", phase)
        priced = pricing.scaling.overhead(args.tp)
        print(f"{phase}: {window.steps} steps, {window.rows} rows, all_reduce {window.reduce_s / window.steps * 1e3:.2f} ms "
              f"and broadcast {window.broadcast_s / window.steps * 1e3:.2f} ms a step")
        if costs is not None:
            o = pricing.scaling.overhead(args.tp, costs)
            print(f"  o({args.tp}, {rows}): live {o.step_s(0, rows) * 1e3:.2f} ms (a + sync {o.fixed_s * 1e3:.2f} ms, "
                  f"b {o.per_row_s * 1e6:.2f} us a row); priced without it {priced.step_s(0, rows) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
