"""Where a process tree's resident memory goes: each process's RSS and PSS, and its largest mappings.

    python scripts/process_memory.py PID [--top N]

For PID and every live descendant (a `pdserve serve` process: its workers and their helpers), from
/proc/PID/smaps: RSS and PSS (PSS splits a page among the processes that map it, so PSS sums over
processes without counting shared libraries twice), and the N mappings with the most resident
memory, summed by name (`[heap]`, `[anon]`, a shared-memory segment, a library, a mapped file).
The last line is the tree's totals.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict

_RANGE = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def tree(root: int) -> list[int]:
    """`root` and its live descendants."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    children[int(stat.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
            except OSError:
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children[pid])
    return out


def mappings_kib(pid: int) -> dict[str, list[int]]:
    """Mapping name -> [RSS KiB, PSS KiB, size KiB], summed over the mappings of that name."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if _RANGE.match(line):
                name = os.path.basename(fields[5]) if len(fields) > 5 else "[anon]"
            elif fields[0] in ("Rss:", "Pss:", "Size:"):
                sums[name][("Rss:", "Pss:", "Size:").index(fields[0])] += int(fields[1])
    return sums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pid", type=int)
    p.add_argument("--top", type=int, default=6, help="largest mappings shown per process")
    args = p.parse_args()
    total_rss = total_pss = 0
    for pid in tree(args.pid):
        try:
            maps = mappings_kib(pid)
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ")[:100]
        except OSError:
            continue  # gone meanwhile
        rss, pss = sum(m[0] for m in maps.values()), sum(m[1] for m in maps.values())
        total_rss, total_pss = total_rss + rss, total_pss + pss
        print(f"pid {pid}: RSS {rss / 1024:,.0f} MiB, PSS {pss / 1024:,.0f} MiB  {command}")
        for name, (r, s, size) in sorted(maps.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"    {r / 1024:8.1f} RSS {s / 1024:8.1f} PSS {size / 1024:9.1f} size (MiB)  {name}")
    print(f"all: RSS {total_rss / 1024:,.0f} MiB, PSS {total_pss / 1024:,.0f} MiB")


if __name__ == "__main__":
    main()
