"""What a tensor-parallel worker's rank 0 spends in collectives, per phase, since its last report.

Contract: `CollectiveTally.add(phase, rows, reduce_s, broadcast_s)` records one step that rank 0
ran (engine/tp_group.py `TpLeader.forward`): its phase ("prefill" when the step prefills any
prompt rows, a mixed step included; "decode" otherwise), its rows (every row of the flat step:
the all_reduces move [rows, d] partials whatever the phase), rank 0's wall seconds inside the
step's all_reduce calls (model/tp.py `reduce_s`) and inside the broadcast of the step's rows.
`take()` returns the totals since the previous `take()` as a `CollectiveReport` and starts a new
window; the worker's heartbeat sends it (workers/heartbeat.py, `Load.collectives`) and the
router folds it into a live price of the worker's collectives (router/live_collectives.py).
`add` runs on the engine's step thread and `take` on the heartbeat thread: a lock pairs them.
The report is a frozen msgspec Struct (it crosses the worker -> router boundary).
"""

from __future__ import annotations

import threading

import msgspec

PHASES = ("prefill", "decode")


class PhaseCollectives(msgspec.Struct, frozen=True):
    """One phase's steps in a report window."""

    steps: int = 0
    rows: int = 0  # summed over the steps (prefill: tokens; decode: sequences, replays included)
    reduce_s: float = 0.0  # rank 0's wall seconds inside all_reduce
    broadcast_s: float = 0.0  # rank 0's wall seconds broadcasting the steps' rows


class CollectiveReport(msgspec.Struct, frozen=True):
    """Both phases' windows since the previous report."""

    prefill: PhaseCollectives = PhaseCollectives()
    decode: PhaseCollectives = PhaseCollectives()

    def phase(self, name: str) -> PhaseCollectives:
        return self.prefill if name == "prefill" else self.decode


class CollectiveTally:
    """The open window of both phases (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = {p: [0, 0, 0.0, 0.0] for p in PHASES}  # steps, rows, reduce_s, broadcast_s

    def add(self, phase: str, rows: int, reduce_s: float, broadcast_s: float) -> None:
        with self._lock:
            acc = self._open[phase]
            acc[0] += 1
            acc[1] += rows
            acc[2] += reduce_s
            acc[3] += broadcast_s

    def take(self) -> CollectiveReport:
        """The window's totals; the next window starts empty."""
        with self._lock:
            closed, self._open = self._open, {p: [0, 0, 0.0, 0.0] for p in PHASES}
        return CollectiveReport(*(PhaseCollectives(*closed[p]) for p in PHASES))
