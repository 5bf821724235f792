"""The placement search: candidate shapes, per-phase scores, deployments and the decision.

Imports `pdserve.sim` and `pdserve.latency`; neither imports it.
"""
