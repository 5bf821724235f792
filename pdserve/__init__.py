"""pdserve: prefill/decode disaggregated LLM serving and K/V placement.

Package layout follows a request's path: api -> router -> workers -> handoff -> engine -> model,
with bench/ (two-clock goodput), sim/ (simulator and planner) and ledger/ (shared arithmetic) beside
them. Lower layers never import upper ones.
"""

__version__ = "0.1.0"
