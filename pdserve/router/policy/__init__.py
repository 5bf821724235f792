"""Where one request goes: the route policies, the pair search and the per-request P/D decision.

    policies.py      round_robin, jsq, slo, prefix: pure functions snapshot -> Choice | Refusal
    choice.py        what a policy reads besides the snapshot, and what it answers
    demand.py        tokens and blocks a request needs at P and D given each worker's prefix hits
    pair_search.py   the hard gates and the fastest admitted pair every cost-aware policy shares
    pd_decision.py   disaggregate, or prefill on the chosen decode worker; the policy `serve` builds
    live_pricing.py  a route's pair priced by its workers' own live collectives
    plan.py          Choice -> block holds + RoutePlan with predicted TTFT/TPOT
"""
