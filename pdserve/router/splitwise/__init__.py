"""Splitwise's pools: when a worker moves between the prompt and the token pool (pure, no I/O).

    splitwise.py   the pool controller: observations in, at most one move out (lend, return, change)
    mixed_pool.py  which pool a `mixed` worker serves, decided per route
"""
