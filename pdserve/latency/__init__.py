"""Latency models: what one engine iteration of a TP x PP instance costs (docs/planner.md).

One-way imports: `base` <- `hardware`, `geometry` <- `roofline`, `profiled`, `aic` <- `load`, `spec`.
"""
