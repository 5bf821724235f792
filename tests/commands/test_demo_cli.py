"""`pdserve demo --json` as a user runs it (README, "A first request"): its own cluster, a mixed
streaming workload, every disaggregated completion equal to the colocated one. From b25f572 to
70fece2 every invocation ended `error: --port must be in 1..65535, got 0` and no test ran the
command itself."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.api.served_cli import ROOT


def test_demo_serves_its_workload_and_every_completion_matches_colocated():
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "demo", "--json", "--num-requests", "4"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["completed"] == 4 and report["failed"] == 0 and report["errors"] == []
    assert report["exact_match"] is True and report["num_exact"] == 4
