"""Write the committed load-shift trace (issue "The seed's scheduling systems", Splitwise figure).

Two phases on one clock: PHASE_A_S seconds of long prompts (1024-2048 tokens) with 8-token
outputs at RATE_A req/s, then PHASE_B_S seconds of 32-token prompts with 256-token outputs at
RATE_B req/s; Poisson arrivals, seeded. The first phase presses the prompt pool, the second the
token pool. Usage: python scripts/make_load_shift_trace.py [OUT.jsonl]
"""

from __future__ import annotations

import json
import os
import random
import sys

# defaults made the committed trace; env overrides (RATE_A, RATE_B, PHASE_A_S, PHASE_B_S) write another
PHASE_A_S, RATE_A = float(os.environ.get("PHASE_A_S", 150)), float(os.environ.get("RATE_A", 0.35))
PHASE_B_S, RATE_B = float(os.environ.get("PHASE_B_S", 150)), float(os.environ.get("RATE_B", 1.6))
SEED = 21


def phase(rng: random.Random, start_s: float, length_s: float, rate: float, prompt, output: int) -> list[dict]:
    entries, t = [], start_s + rng.expovariate(rate)
    while t < start_s + length_s:
        entries.append({"arrival_s": round(t, 3), "prompt_len": prompt(rng), "output_len": output})
        t += rng.expovariate(rate)
    return entries


def main(path: str) -> None:
    rng = random.Random(SEED)
    entries = phase(rng, 0.0, PHASE_A_S, RATE_A, lambda r: r.randint(1024, 2048), 8)
    entries += phase(rng, PHASE_A_S, PHASE_B_S, RATE_B, lambda r: 32, 256)
    with open(path, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
    print(f"{path}: {len(entries)} requests over {PHASE_A_S + PHASE_B_S:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "scripts/traces/load_shift.jsonl")
