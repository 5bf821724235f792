"""Simulated requests per second of `pdserve simulate` on the bar case, for several checkouts in one run.

    python scripts/sim_speed.py [--repeats 3] CHECKOUT [CHECKOUT ...]

Each checkout (a git worktree's root) runs the whole command, process start and parser included,
as a user types it: a 1P1D disaggregated deployment under a constant latency model (20 ms prefill,
10 ms decode step), 200,000 Poisson requests at 20 req/s, 256-token prompts, 16 output tokens.
Runs alternate between the checkouts, so a shared machine's load falls on each alike; the figure
is num_requests over the median child CPU time (user + system) and over the median wall time,
and the ratio of each to the first checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

NUM_REQUESTS = 200_000
CONSTANT = {"kind": "constant", "prefill_ms": 20, "decode_step_ms": 10}
ARGS = ["simulate", "--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--rate", "20",
        "--arrival", "poisson", "--num-requests", str(NUM_REQUESTS), "--input-len", "256", "--output-len", "16", "--json"]


def run_once(checkout: str, model_path: str) -> tuple[float, float]:
    """(wall s, child CPU s) of one `pdserve simulate` from `checkout`."""
    code = "import sys; from pdserve.cli import main; sys.exit(main())"
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *ARGS, "--latency-model", model_path], env=env, check=True,
                         capture_output=True, text=True, cwd=checkout).stdout
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if json.loads(out)["completed"] != NUM_REQUESTS:
        raise RuntimeError(f"{checkout}: not every request completed")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(CONSTANT, f)
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in args.checkouts}
    for _ in range(args.repeats):
        for checkout in args.checkouts:
            times[checkout].append(run_once(checkout, f.name))
    os.unlink(f.name)
    base = None
    for checkout, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        rps = (NUM_REQUESTS / cpu, NUM_REQUESTS / wall)
        base = base or rps
        print(f"{checkout}: {rps[0]:,.0f} req/s per CPU second ({rps[0] / base[0]:.2f}x), "
              f"{rps[1]:,.0f} req/s per wall second ({rps[1] / base[1]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
