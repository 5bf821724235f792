"""Validation of a plan against the local runtime (`pdserve plan --validate`).

Imports `pdserve.search`, `pdserve.sim` and `pdserve.latency`; nothing below imports it.
"""
