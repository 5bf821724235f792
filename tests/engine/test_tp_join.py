"""A tensor-parallel group whose other ranks never join ends the join with an error instead of
waiting for good (engine/tp_group.py, JOIN_TIMEOUT): the join used the group's own 30-day
timeout, so a follower that died at start, or a port taken between `free_local_port()` and the
store's bind, left rank 0 (a served worker, or the cost-model fit's child that `serve` waits for
before any timeout of its own counts) waiting; a fresh-clone CI run once sat 240 s there."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from pdserve.engine.tp_group import GROUP_TIMEOUT, JOIN_TIMEOUT, init_group
from pdserve.ports import free_local_port


def test_a_join_nobody_else_makes_raises_at_its_timeout():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="clients"):
        init_group(free_local_port(), 0, 2, join_timeout=timedelta(seconds=1))
    assert time.monotonic() - started < 30  # the bound, not the group's 30 days
    assert JOIN_TIMEOUT < GROUP_TIMEOUT
