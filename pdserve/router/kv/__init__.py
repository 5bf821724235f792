"""Where K/V lives in the cluster, and moving it between workers.

    kv_index.py      the cluster K/V index: which worker holds which prefix block (block events)
    kv_inbox.py      block-event reports queued at the edge, applied off the routing path
    prefix_index.py  the leading prefix each worker of a pool can already see for one request
    prefix_terms.py  the prefix policy's per-slot placement terms and their trace record
    fetch_plan.py    cross-worker prefix fetch planning: pure cost terms
    fetch_runner.py  the router process's side of a cross-worker fetch, and its metrics
"""
