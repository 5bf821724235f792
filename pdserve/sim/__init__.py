"""The discrete-event simulator: pools, queueing, K/V transfer and goodput (docs/planner.md).

Imports only `pdserve.latency` (and bench/ledger); the search and validation import it.
"""
