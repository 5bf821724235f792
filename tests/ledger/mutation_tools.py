"""Helpers for one-field fixture mutations: copy a fixture and change the value at one path."""

from __future__ import annotations

import copy
from typing import Any



class _Delete:
    """The "remove this field" marker; its repr is stable, so test ids are the same in every
    process (pytest-xdist's workers must collect identical ids)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()


def _step(key: str, node: Any) -> Any:
    return int(key) if isinstance(node, list) else key


def mutated(fixture: dict, path: str, value: Any) -> dict:
    """Deep copy of `fixture` with the dotted `path` (list indexes as numbers) set to `value`,
    or removed when `value` is DELETE."""
    out = copy.deepcopy(fixture)
    *parents, last = path.split(".")
    node: Any = out
    for key in parents:
        node = node[_step(key, node)]
    key = _step(last, node)
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    return out
