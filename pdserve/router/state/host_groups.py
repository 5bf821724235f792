"""Decode slots grouped by host, so a policy takes per-host minima in one numpy call.

Contract: `HostGroups.build(prefill_hosts, decode_hosts)` sorts the decode slots by host
(`decode_order`), marks where each host's run starts (`group_starts`, for
np.minimum.reduceat) and maps each prefill slot to the group of its host (`prefill_group`; a
host without a decode worker maps to len(group_starts), a sentinel group). Arrays are read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HostGroups:
    """Decode slots grouped by host, for per-host minima (np.minimum.reduceat)."""

    decode_order: np.ndarray  # decode slots sorted by host
    group_starts: np.ndarray  # where each host's run starts in decode_order
    prefill_group: np.ndarray  # [P] the group of P's host, or len(group_starts) if no decode there
    all_grouped: bool = False  # every prefill host has a decode worker (no sentinel group needed)

    @classmethod
    def build(cls, prefill_hosts: Sequence[str], decode_hosts: Sequence[str]) -> HostGroups:
        names = sorted(set(decode_hosts))
        group_of = {name: g for g, name in enumerate(names)}
        order = sorted(range(len(decode_hosts)), key=lambda j: (group_of[decode_hosts[j]], j))
        sizes = [sum(1 for h in decode_hosts if h == name) for name in names]
        starts = np.cumsum([0] + sizes[:-1]) if sizes else np.zeros(0)
        groups = [group_of.get(h, len(names)) for h in prefill_hosts]
        arrays = [np.array(a, dtype=np.int64) for a in (order, starts, groups)]
        for array in arrays:
            array.flags.writeable = False
        return cls(*arrays, all_grouped=all(g < len(names) for g in groups))
