"""The admission line (router/process/frontend_admission.py): first come, first served by
arrival, whatever order the waiters join, leave or come back in."""

from __future__ import annotations

from pdserve.router.process.frontend_admission import AdmissionLine


def test_only_the_earliest_waiting_arrival_may_route():
    line = AdmissionLine()
    assert line.first("new", 5.0)  # nobody waits: route at once
    line.join("b", 2.0)
    line.join("a", 1.0)
    line.join("c", 3.0)
    assert line.first("a", 1.0) and not line.first("b", 2.0) and not line.first("new", 5.0)
    assert line.first("early", 0.5)  # one that arrived before every waiter (a retry of an admitted request)
    line.leave("a")
    assert line.first("b", 2.0) and not line.first("c", 3.0)
    line.join("b", 2.0)  # joining twice changes nothing
    line.leave("b")
    line.join("b", 2.0)  # left and came back: waits again in its place
    assert line.first("b", 2.0) and len(line) == 2
    line.leave("b")
    line.leave("c")
    assert line.first("new", 5.0) and len(line) == 0
