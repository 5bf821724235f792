"""What a tensor-parallel worker's rank 0 spends in collectives, per phase, since its last report.

Contract: `CollectiveTally.add(phase, rows, reduce_s, broadcast_s)` records one step that rank 0
ran (engine/tp_group.py `TpLeader.forward`): its phase ("prefill" when the step prefills any
prompt rows, a mixed step included; "decode" otherwise), its rows (every row of the flat step:
the all_reduces move [rows, d] partials whatever the phase), rank 0's wall seconds inside the
step's all_reduce calls (model/tp.py `reduce_s`) and inside the broadcast of the step's rows
(with the sums of rows^2 and rows x all_reduce seconds, which a per-step line needs).
`take()` returns the totals since the previous `take()` as a `CollectiveReport` and starts a new
window; the worker's heartbeat sends it (workers/heartbeat.py, `Load.collectives`) and the
router folds it into a live price of the worker's collectives (router/pricing/live_collectives.py).
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
    rows_sq: int = 0  # sum over the steps of rows^2 and of rows x reduce_s: a window of steps of
    rows_reduce_s: float = 0.0  # different sizes still gives the per-step line (router/pricing/live_collectives.py)


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
        self._open = {p: _empty() for p in PHASES}  # PhaseCollectives' fields, in order

    def add(self, phase: str, rows: int, reduce_s: float, broadcast_s: float) -> None:
        with self._lock:
            acc = self._open[phase]
            for i, value in enumerate((1, rows, reduce_s, broadcast_s, rows * rows, rows * reduce_s)):
                acc[i] += value

    def take(self) -> CollectiveReport:
        """The window's totals; the next window starts empty."""
        with self._lock:
            closed, self._open = self._open, {p: _empty() for p in PHASES}
        return CollectiveReport(*(PhaseCollectives(*closed[p]) for p in PHASES))


def _empty() -> list:
    return [0, 0, 0.0, 0.0, 0, 0.0]
