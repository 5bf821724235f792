"""The control plane: which (prefill, decode) pair serves a request, and what it holds.

The core is pure (no I/O); the process edge feeds `Router` (router.py, the facade) worker
messages and request events. One sub-package per job, imported one way (tests/router/test_router_layout.py):

    messages.py, errors.py, contract.py, kernels.py   the vocabulary every layer reads
    pricing/    the cost model and the prices measured while serving
    kv/         the cluster K/V index, prefix hits, cross-worker fetch
    state/      membership, the hold ledger, the snapshot policies read
    policy/     route policies, the pair search, the per-request P/D decision, route plans
    tetri/      TetriInfer: reserved decode length, p2c decode placement
    splitwise/  Splitwise's pool controller and mixed pool (pure)
    router.py, config.py, answers.py, synthetic.py    the facade that composes them
    process/    the router process's edge: zmq, admission, events, upkeep, control, release
    runahead/   KV-Runahead chains
"""
