"""Planner: latency models, a discrete-event simulator and the placement search (docs/planner.md)."""
