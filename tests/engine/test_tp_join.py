"""A tensor-parallel group whose other ranks never join ends the join with an error instead of
waiting for good (engine/tp_group.py, JOIN_TIMEOUT): the join used the group's own 30-day
timeout, so a follower that died at start, or a port taken between `free_local_port()` and the
store's bind, left rank 0 (a served worker, or the cost-model fit's child that `serve` waits for
before any timeout of its own counts) waiting; a fresh-clone CI run once sat 240 s there. A
follower that ends before the group is whole fails the join at once, named."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest

from pdserve.engine.tp_group import GROUP_TIMEOUT, JOIN_TIMEOUT, TpStartError, init_group, join_watching
from pdserve.ports import free_local_port


def test_a_join_nobody_else_makes_raises_at_its_timeout():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="clients"):
        init_group(free_local_port(), 0, 2, join_timeout=timedelta(seconds=1))
    assert time.monotonic() - started < 30  # the bound, not the group's 30 days
    assert JOIN_TIMEOUT < GROUP_TIMEOUT


def test_a_follower_that_ends_before_the_join_fails_it_at_once_naming_the_rank():
    """Rank 0 watches its followers while it waits in the join: one that exits (killed while
    loading, say) ends the join with `TpStartError` naming its rank and exit, not at the timeout."""
    follower = mp.get_context("spawn").Process(target=os._exit, args=(3,), daemon=True)
    follower.start()
    started = time.monotonic()
    with pytest.raises(TpStartError, match=rf"rank 1 \(pid {follower.pid}\) exited with code 3 before the group was whole"):
        join_watching(free_local_port(), 2, [follower], join_timeout=timedelta(seconds=20))
    assert time.monotonic() - started < 10  # the follower's exit, not the join's 20 s
