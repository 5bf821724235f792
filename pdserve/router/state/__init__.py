"""What the router knows of its cluster: members, holds, and the view policies read.

    registry.py      membership: registration, load reports, heartbeats, epochs, retirement
    reservations.py  the block-hold ledger (decode reservations, prefill staging), assert_no_leaks()
    snapshot.py      the per-decision view: one Pool per phase, loads as numpy arrays
    host_groups.py   decode slots grouped by host for per-host minima in one numpy call
"""
