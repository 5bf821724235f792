"""KV-Runahead: one long prompt prefilled by a chain of K prefill workers.

    runahead_plan.py  where the prompt is cut between the chain's workers (partition search)
    runahead.py       the chain as the router process runs it
"""
