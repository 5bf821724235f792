"""Shares of the served path's time from `scripts/profile_served.sh`'s samples (issue 39, part 2).

    python scripts/profile_served.py OUT_DIR

For the worker and the serving process at each concurrency: the samples py-spy took (100 Hz over
25 s: 2,500 is one thread busy throughout), the share inside the model's forward and inside the C
GEMM kernels, and the largest leaf frames. A sample whose leaf is asyncio's `Runner.run` is the
event loop inside uvloop's C code (waiting in epoll included: py-spy cannot tell the two apart), so
the serving process's busy time is bounded above by its samples and below by those without it.
Then the front's CPU per output token (busy samples over the tokens the run produced in the window)
and the memory and K/V block snapshots.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

HZ, WINDOW_S = 100, 25


def stacks(path: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if frames:
            out.append((frames.split(";"), int(count)))
    return out


def share(rows: list[tuple[list[str], int]], needle: str) -> float:
    total = sum(n for _, n in rows) or 1
    return sum(n for frames, n in rows if any(needle in f for f in frames)) / total


def leaves(rows: list[tuple[list[str], int]], top: int = 6) -> list[tuple[str, float]]:
    total = sum(n for _, n in rows) or 1
    count: Counter[str] = Counter()
    for frames, n in rows:
        count[re.sub(r"\s+\(", " (", frames[-1])] += n
    return [(name, n / total) for name, n in count.most_common(top)]


def main(out: Path) -> None:
    for c in (8, 32):
        report = json.loads((out / f"bench.c{c}.json").read_text())
        tok_s = report.get("summary", report)["output_throughput"]
        for proc in ("worker", "serve"):
            rows = stacks(out / f"{proc}.c{c}.txt")
            total = sum(n for _, n in rows)
            print(f"concurrency {c}, {proc}: {total} samples ({total / HZ:.2f} s busy of {WINDOW_S} s at most)")
            if proc == "worker":
                print(f"  model forward {share(rows, 'forward (pdserve/model'):.3f}, "
                      f"C GEMM kernels {share(rows, 'ckernel.py'):.3f}")
            else:
                loop = sum(n for frames, n in rows if frames[-1].startswith("Runner.run"))
                busy_hi, busy_lo = total / HZ, (total - loop) / HZ
                per_tok = [1e3 * b / (tok_s * WINDOW_S) for b in (busy_lo, busy_hi)]
                print(f"  uvloop's C loop {loop / max(total, 1):.3f}; front CPU per output token "
                      f"{per_tok[0]:.2f}-{per_tok[1]:.2f} ms at {tok_s:.1f} tok/s")
            for name, frac in leaves(rows):
                print(f"    {frac:.3f}  {name}")
    for name in ("idle", "c8", "c32"):
        memory = (out / f"memory.{name}.txt").read_text().splitlines()
        blocks = (out / f"blocks.{name}.txt").read_text().split("\n")
        print(f"after {name}: {memory[-1] if memory else '?'}; " + "; ".join(b for b in blocks if "tier" in b))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
