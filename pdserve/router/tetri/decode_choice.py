"""`--decode-choice p2c`: TetriInfer's decode placement by power-of-two choices on heavy/light load.

Contract: the prefill side stays the `--policy`'s choice; only the decode worker is re-chosen.
`p2c_slot` is pure: among the decode slots whose headroom covers the request's decode hold (the
alpha set of ledger/tetri.py), it compares the two sampled slots `picks` and keeps the one
whose heavy-to-light ratio after admitting the request is lower (`tetri.power_of_two_choice`,
the ledger's one copy of the rule); equal ratios (all-light workers, say) go to the one with fewer
live decodes, then by name. With one eligible slot it is that slot;
with none, None (the policy's choice stands and admission refuses as before).
`HeavyLight` counts, per decode worker, the live routes predicted heavy and light; the router
adds a route when it is admitted and removes it with its holds. `p2c_choice` applies the rule to
a policy's `Choice` over a snapshot (the router's step after the policy).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import numpy as np

from pdserve.ledger.tetri import DecodeWorker, heavy_light_ratio_after, power_of_two_choice
from pdserve.router.messages import RouteRequest
from pdserve.router.policy import demand
from pdserve.router.policy.choice import Choice
from pdserve.router.policy.policies import prefix_hits
from pdserve.router.state.snapshot import Snapshot

CHOICES = ("policy", "p2c")


def p2c_slot(names: Sequence[str], headroom: Sequence[int], need: Sequence[int], heavy: Sequence[int],
             light: Sequence[int], request_heavy: bool, picks: tuple[int, int]) -> int | None:
    """The chosen decode slot. `need[s]`: blocks the hold needs on slot s; `picks`: two indices
    into the eligible slots (ascending slot order), taken modulo its size."""
    eligible = [s for s in range(len(names)) if headroom[s] >= need[s]]
    if not eligible:
        return None
    if len(eligible) == 1:
        return eligible[0]
    a = eligible[picks[0] % len(eligible)]
    b = eligible[picks[1] % len(eligible)]
    if a == b:
        b = eligible[(picks[0] + 1) % len(eligible)]
    workers = {s: DecodeWorker(names[s], int(headroom[s]), int(heavy[s]), int(light[s])) for s in (a, b)}
    ratios = {s: heavy_light_ratio_after(workers[s], request_heavy) for s in (a, b)}
    if ratios[a] == ratios[b] and heavy[a] + light[a] != heavy[b] + light[b]:
        return min((a, b), key=lambda s: heavy[s] + light[s])  # equal mix (e.g. all light): the less loaded
    chosen = power_of_two_choice(workers[a], workers[b], request_heavy)
    return a if chosen is workers[a] else b


def p2c_choice(snapshot: Snapshot, request: RouteRequest, choice: Choice, heavy_light: HeavyLight,
               picks: tuple[int, int], block_size: int) -> Choice:
    """Keep the policy's prefill slot and re-choose the decode slot by `p2c_slot` over the slots'
    headroom, the request's decode hold at each (its visible hit there) and their heavy/light
    routes. Colocated: the one worker is the decode worker, so both slots move."""
    d = snapshot.decode
    _, d_hit = prefix_hits(snapshot, request, block_size)
    hit = [int(d_hit[s]) if isinstance(d_hit, np.ndarray) else int(d_hit) for s in range(len(d))]
    need = [int(demand.decode_blocks(request, h, block_size)) for h in hit]
    counts = [heavy_light.counts(w) for w in d.worker_ids]
    slot = p2c_slot(list(d.worker_ids), [int(x) for x in d.headroom_blocks], need, [c[0] for c in counts],
                    [c[1] for c in counts], request.heavy, picks)
    if slot is None or slot == choice.decode_slot:
        return choice
    if snapshot.colocated:
        return Choice(slot, slot, hit[slot], hit[slot])
    return Choice(choice.prefill_slot, slot, choice.prefill_hit_blocks, hit[slot])


class Sampler:
    """Two distinct draws per decision from a fixed seed: the same run routes the same way."""

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def picks(self) -> tuple[int, int]:
        return self._rng.randrange(1 << 30), self._rng.randrange(1 << 30)


class HeavyLight:
    def __init__(self) -> None:
        self._routes: dict[str, tuple[str, bool]] = {}  # request id -> (decode worker, heavy)
        self._counts: Counter[tuple[str, bool]] = Counter()

    def add(self, request_id: str, worker_id: str, heavy: bool) -> None:
        self.remove(request_id)
        self._routes[request_id] = (worker_id, heavy)
        self._counts[(worker_id, heavy)] += 1

    def remove(self, request_id: str) -> None:
        entry = self._routes.pop(request_id, None)
        if entry is not None:
            self._counts[entry] -= 1

    def counts(self, worker_id: str) -> tuple[int, int]:
        """(heavy, light) live routes decoding on the worker."""
        return self._counts[(worker_id, True)], self._counts[(worker_id, False)]

    def __len__(self) -> int:
        return len(self._routes)
