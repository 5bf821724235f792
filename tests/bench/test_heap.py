"""`frozen_heap` freezes what exists for the block and hands everything back on exit."""

from __future__ import annotations

import gc
import weakref

import pytest

from pdserve.heap import frozen_heap


def test_freezes_for_the_block_and_unfreezes_after():
    gc.unfreeze()
    long_lived = [object() for _ in range(100)]
    with frozen_heap():
        assert gc.get_freeze_count() >= len(long_lived)
        made_inside = [[] for _ in range(10)]
        assert gc.get_freeze_count() >= len(long_lived)
    assert gc.get_freeze_count() == 0
    assert len(made_inside) == 10


def test_unfreezes_when_the_block_raises():
    gc.unfreeze()
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


class _Node:
    pass


def test_cyclic_garbage_made_inside_is_still_collected():
    with frozen_heap():
        node = _Node()
        node.self = node  # a cycle: only the collector can free it
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
